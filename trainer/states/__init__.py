"""Hidden states: where the verifier's aux and last-layer states come from during training, behind one interface
(`HiddenStateSource`, trainer/states/source.py).

    source.py        the interface, `VerifierStates`, per-document sources, `document_key`, `document_segments`
    in_process.py    the verifier in this process (default); `verifier_hidden_states`, one decoder forward
    memory.py        an in-memory row cache in front of another source
    vllm.py          vLLM servers extracting states online
    cache_format.py  the offline cache's on-disk format (plan, shards, durable writes)
    offline_cache.py its writer (`write_cache`) and reader (`OfflineCache`)
    hybrid.py        the cache, else an online source
    build.py         the source a run config names
    cache_cli.py     the command that writes a cache
"""
