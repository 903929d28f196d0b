"""The ``kiln`` command (``main``) and its subcommands: precompile (``precompile``,
``precompile_gpu``, ``autotune_queue``), package (``package_cmd``), the demo."""
