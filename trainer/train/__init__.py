"""Training: the objective, the optimizer, the Trainer and what it writes.

    anchors.py      which blocks are trained (anchors, supervision mask, decay)
    loss.py         the chunked DSpark loss and `ObjectiveConfig`
    stats.py        the teacher-forced metrics the loss accumulates
    optim.py        Muon for matrices, AdamW for the rest
    adapters.py     LoRA adaptation of an existing drafter
    trainer.py      `DSparkTrainer` (transformers.Trainer): one step, evaluation, atomic checkpoints
    calibration.py  the confidence head's logistic calibration, folded into its weights
    checkpoints.py  the run directory: checkpoints, completion markers, resume, the run lock
"""
