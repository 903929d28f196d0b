"""The processes ``kiln farm up`` starts: the gateway clients reach without Ray
(``gateway``), the local cluster's start and stop (``cluster``), the gateway's wire
format (``wire``), and the farm's address and token files (``farm_files``)."""
