"""Transformations of a built model's layers that change how they run, not what they compute: activation
recomputation (``recompute``) and regional compilation (``regional_compile``).

They sit above the models: a model declares what may be recomputed (``recompute_plan()``, next to its
``tensor_parallel_plan()``) and which layers it repeats (``pipeline_blocks()``), and these modules act on the
names it declares, so they import no model and no model imports them.
"""
