"""``lightning-megatron simulate``: the real training step of an N-GPU job, one rank at a time, in one CPU process.

``step.simulate_rank`` runs the strategy's set-up and step for one rank on fake tensors over torch's fake process
group (``fake_world``), recording its memory and collectives (``records``); ``report`` chooses the ranks that
differ, compares each with the planner's prediction and prints the table.
"""
