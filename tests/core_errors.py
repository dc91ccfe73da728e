"""What the core's error messages say, per error class: the stems of every
message cpp/cellcache raises with that status (cell_cache.cpp, step.cpp), for
tests that know an error's class but not its exact values (the shared case
files name only the class; the state machine's model names only the class)."""

MESSAGES = {
    "UnknownSequenceError":
        r"unknown sequence id -?\d+ \(not handed out by seq_new/seq_clone, or already freed\)",
    "StepInvalidatedError":
        r"the declared step was invalidated by a sequence verb; declare it again",
    "StepNotDeclaredError":
        r"layer -?\d+ (ran a forward with no declared step|was already served in this step"
        r"|has not been placed in the current step)",
    "PositionConflictError":
        r"got \d+ positions for a step declared with \d+ tokens"
        r"|token \d+ has position -?\d+ but the step was placed with -?\d+"
        r"|token \d+ \(sequence \d+\) at position -?\d+: (position out of range|not after "
        r"position -?\d+ that the sequence already holds|positions of a sequence must strictly "
        r"increase within a step)",
    "LayerOutOfRangeError": r"layer -?\d+ is out of range \[0, \d+\)",
    "InvalidConfigError":
        r"\b(n_cells|n_layers|windows?|window_cells|retained_margin|pool)\b.*\bgot\b",
    "BelowReclaimedError":
        r"(seq_rm of sequence \d+ from position \d+|seq_clone of sequence \d+ upto \d+): the "
        r"window-\d+ pool has reclaimed sequence \d+'s \d+ positions below \d+; (a range "
        r"starting below \d+ must start at 0 and reach \d+|a query at the new next position "
        r"could need them \(keep the sequence's next position >= \d+, or remove from position "
        r"0\))",
}
