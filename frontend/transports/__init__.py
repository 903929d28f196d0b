"""The client's transports to a farm, behind one interface (``base.Farm``): in process,
the gateway of ``kiln farm up``, a Ray cluster joined here or from a child process.
``modes.farm_for`` picks one from ``KILN_FARM``."""
