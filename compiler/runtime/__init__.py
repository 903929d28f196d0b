"""What generated code needs at run time: Triton helpers, kernel launchers, C++ loading."""
