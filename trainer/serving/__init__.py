"""Serving transport: talking to a running vLLM server and starting one; the same for llama.cpp on a CPU.

    http.py           requests, errors and checks every vLLM backend shares
    server.py         the hidden-state extraction server's command, start and stop
    cpu_connector.py  vLLM's hidden-states connector for CPU (loaded by the server, never by the trainer)
    llamacpp.py       llama.cpp: its pinned build, its GGUF converter, a llama-server started here, its counters
"""
