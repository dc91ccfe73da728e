// Routing of ExecuTorch's own log lines for a command-line tool.
//
// ExecuTorch logs loader and kernel failures through its platform layer
// (several lines per failure). The runner already reports each failure as one
// line of its own, so a CLI silences these by default and shows them when
// asked (--verbose). An app embedding the runner keeps its own logging: this
// is never called by the library.
#pragma once

namespace cellcache::runner {

// Installs a log sink: ExecuTorch lines go to stderr when `show` is true and
// are dropped otherwise. Call once, before loading a program.
void route_executorch_log(bool show);

}  // namespace cellcache::runner
