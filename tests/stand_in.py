"""A scripted OpenAI-compatible HTTP server for the client tests (the clients' logic, not vLLM's).

`GET` answers `/v1/models` with `served` (its `root` and `max_model_len` too); each `POST` is answered by
`answer(path, body)`, which returns `(status, json)` or `(status, json, delay seconds)`. Every request is recorded
as `(path, headers, body)`; `bodies` lists the POST bodies. With `echo_headers`, an error answer echoes the request
headers back (as some proxies do), so a client that sent a secret would print it in its own messages.
"""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StandIn:
    def __init__(self, answer, served="demo/model", root=None, max_model_len=2048, echo_headers=False):
        self.answer, self.requests, self.lock = answer, [], threading.Lock()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status, payload):
                if echo_headers and status >= 400:
                    payload = {**payload, "echo": dict(self.headers)}
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                with stand_in.lock:
                    stand_in.requests.append((self.path, dict(self.headers), None))
                self.reply(200, {"data": [{"id": served, "root": root or f"/models/{served}",
                                           "max_model_len": max_model_len}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stand_in.lock:
                    stand_in.requests.append((self.path, dict(self.headers), body))
                status, payload, *delay = stand_in.answer(self.path, body)
                if delay:
                    time.sleep(delay[0])
                self.reply(status, payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def bodies(self) -> list[dict]:
        with self.lock:
            return [body for _, _, body in self.requests if body is not None]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
