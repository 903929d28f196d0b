"""Shared text of the child scripts that test a warm start in a fresh process: the lines
that count AOTAutograd's traces in the child (at torch's own entry point, in ``traces``)."""

COUNT_AOT_TRACES = """import torch._dynamo.backends.common as common
traces = []
real = common.aot_module_simplified
def counted(*args, **kwargs):
    traces.append(1)
    return real(*args, **kwargs)
common.aot_module_simplified = counted
"""
