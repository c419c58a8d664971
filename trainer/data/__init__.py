"""Data: chat rows -> the verifier's tokens -> packed training rows, plus the draft vocabulary and regeneration.

    files.py       strict pre-scan of local JSON/JSONL/Parquet files (bad-line policy)
    load.py        chat rows from the Hub or local files into a `datasets.Dataset`
    render.py      verifier chat template, assistant-only loss mask, train/validation split
    packing.py     conversations -> packed rows, the collator, supervised-token counts
    prepare.py     the run's data path (`prepare_data`), shared by training and the cache writer
    vocab.py       the draft vocabulary (most frequent supervised tokens)
    regenerate.py  the regeneration command: answers by the verifier itself
    replies.py     regenerated records, per-request seeds, the ordered resumable writer
    generators.py  its two backends (in-process transformers, a vLLM server)
"""
