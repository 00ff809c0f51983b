"""``python -m benchmarks.memory MODE``: one tool for what a rank's memory holds, measured against the formulas.

Modes (each its own module here, each printing one table; ``python -m benchmarks.memory MODE --help``):

==============  ======================================================================================================
``model-state`` per-rank parameter, gradient, main-parameter and optimizer bytes of ZeRO 0/1/2 against the ZeRO
                formulas, Lightning's DDP and FSDP, peak memory and tokens/s (``model_state.py``)
``activations`` the bytes autograd saves for backward per rank under context parallelism (ring, all-gather) and
                tensor + sequence parallelism, against 1/cp and 1/tp of the whole sequence (``activations.py``)
``peak``        each rank's measured peak of activation bytes over a step, for tp/SP/pp, recomputation modes and
                the chunked loss (``peak.py``)
``logits``      the output layer and its loss at Llama-3's vocabulary, unchunked against chunked (``logits.py``)
``formulas``    FLOPs, bytes sent per group and saved activations per rank against the planner's formulas
                (``formulas.py``)
``planner``     the planner's activation peaks against ``peak``'s measurement, its step times against published
                runs (``planner.py``)
==============  ======================================================================================================

The counting itself is the package's (``lightning_megatron.plan.probes``), the layouts are built by the package's
own preparation steps; a mode re-launches this entry point under ``torchrun`` for its ranks
(``ENTRY MODE --worker ...``).
"""

ENTRY = "benchmarks.memory"
