"""The client's core: the Dynamo backend (``backend``), AOTAutograd's graphs hashed and
looked up (``keys``, ``serialize``, ``client``), compiled or loaded (``compile``), large
graphs cut into regions (``regions``), the AOT cache that skips Dynamo's AOT trace on a
warm start (``aot/``), tuned artifacts swapped in (``hotswap``) and kernels warmed up
(``warmup``, ``first_call``, ``overlap``). A graph Kiln cannot compile runs eagerly
(``fallback``)."""
