"""Everything that only training, evaluation and export need (never imported by the remote-code files).

The tree follows the data flow, each subpackage one concern with its map in its `__init__`:

    data/        chat rows -> the verifier's tokens -> packed rows; the draft vocabulary; regeneration
    verifier/    loading the verifier, the small pip-shipped models, its teacher distribution
    serving/     vLLM transport (HTTP client, the extraction server, the CPU connector) and llama.cpp's server
    states/      the verifier's hidden states behind one interface (in process, vLLM, offline cache)
    train/       anchors, loss, optimizer, the Trainer, calibration, checkpoints
    evaluation/  acceptance measured by speculating (in process, vLLM) and the results format
    export/      the servable folder, its model card and plots
    config.py    the run config (model, data, train sections); contract.py what a servable checkpoint holds
    errors.py    the one error path of every command; files.py atomic writes, JSONL, the local-or-Hub rule
    run.py       the training entry (`accelerate launch trainer/run.py`); __main__.py every other command
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]  # the checkout: configs/, data/ and the remote-code files
