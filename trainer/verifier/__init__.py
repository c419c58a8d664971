"""The verifier: loading it (or only its shell), the small real models shipped as PyPI packages, and its teacher.

    loading.py       `load_verifier`, `load_verifier_shell`, `resolve_pretrained` (local path or Hub id)
    small_models.py  models installed with pip (SmolLM2, Gemma 3 270M) converted to transformers folders
    teacher.py       the verifier's next-token distribution the loss compares the draft with
"""
