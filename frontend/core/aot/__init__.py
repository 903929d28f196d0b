"""The AOT cache: a warm start served from the store with no AOTAutograd trace. ``cache``
looks entries up and publishes them, ``entry`` is their wire format, ``training`` runs a
served forward and backward as an autograd Function, ``dynamo_key`` keys a frame."""
