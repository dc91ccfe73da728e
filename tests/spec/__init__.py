"""The Python runtime's scheduling rules, kept as an executable specification
of the C++ engine (cpp/engine/): scheduler, prefix cache, proposers, token
choice. Not part of the package; the tests import it as ``spec``."""
