"""The attention kernels' names and the choices table's version, without torch.

`bcg.runtime.attention` runs the kernels; what only checks a name (the runner's config, the fleet's
choices in `deployments.attention_choices`, which the coordinator imports) reads it here, so a process
that never runs attention never imports torch for it.
"""

__all__ = ["ATTENTION_BACKENDS", "AUTO_CANDIDATES", "CHOICES_VERSION"]

ATTENTION_BACKENDS = ("auto", "sdpa", "cudnn", "flash", "efficient", "math", "fa3", "fa3_fp8")
#: What ``"auto"`` weighs, where available: PyTorch's own choice against kernels it does not have. Exact
#: kernels only: ``"fa3_fp8"`` changes the numbers and runs only where it is named.
AUTO_CANDIDATES = ("sdpa", "fa3")
CHOICES_VERSION = 1   # the format of `AttentionDispatch.export_choices`' table
