"""`python -m prm.serve --model DIR --port P`: a trained PRM behind OpenRLHF's remote reward model protocol, on the
standard library's HTTP server, so `--remote_rm_url http://HOST:P/get_reward` uses it unchanged.

POST /get_reward with {"query": [full text, ...], "prompts": [prompt, ...]} (other fields, e.g. "labels", are
ignored) answers {"rewards": [...], "scores": [...]}: the reward of a query is PRMReward on (its prompt, the rest of
its text). GET /health answers {"status": "ok", ...}.

One client never stops the server for the others: each connection has its own thread (the model runs one request
at a time); a client silent for --timeout seconds is dropped; a body over --max-body-bytes gets a 413 unread; a
missing Content-Length a 411, a malformed one a 400; a body that is not UTF-8 JSON, nests too deeply, holds a number
too long to read, a lone surrogate ("\\ud800": no tokenizer can read it) or a field of the wrong type, a 400; a
failure while scoring, a 500 (its traceback on stderr). Every error is JSON, {"error": message}.
Depends on: prm.reward."""
import argparse
import json
import math
import sys
import threading
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prm.reward import PRMReward

PATH, HEALTH = "/get_reward", "/health"
MAX_BODY = 8 << 20  # bytes: thousands of long rollouts; --max-body-bytes raises it


class BadRequest(ValueError):
    """What is wrong with a request, sent back with its status (400 unless said) as {"error": message}."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def body_size(header, limit: int) -> int:
    """The Content-Length to read, checked before a byte of the body is."""
    if header is None:  # chunked bodies are not read: their size is unknown up front
        raise BadRequest("Content-Length is required", 411)
    digits = header.strip()
    if not (digits.isascii() and digits.isdigit()):  # int() would take '-5', '+5', '1_0' and non-ASCII digits
        raise BadRequest(f"Content-Length {header[:40]!r}: expected a number of bytes")
    if len(digits.lstrip("0")) > 18 or int(digits) > limit:  # 18 digits: int() never meets Python's digit limit
        raise BadRequest(f"a body of {digits[:40]} bytes: over the limit of {limit} (--max-body-bytes)", 413)
    return int(digits)


def read_json(body: bytes):
    """The body as JSON; every way it can be unreadable is a BadRequest."""
    try:
        return json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BadRequest(f"the body is not UTF-8: {e}") from None
    except json.JSONDecodeError as e:
        raise BadRequest(f"the body is not JSON: {e}") from None
    except RecursionError:  # the decoder recurses once per level of [ or {
        raise BadRequest("the body nests too deeply to read") from None
    except ValueError as e:  # an integer past Python's digit limit (int-str conversion)
        raise BadRequest(f"the body holds a number too long to read: {e}") from None


def texts(data: dict, key: str) -> list:
    """data[key], checked to be a list of strings a tokenizer can read."""
    value = data.get(key)
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise BadRequest(f"field '{key}': expected a list of strings, got {type(value).__name__}")
    for i, text in enumerate(value):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's "\ud800" decodes to a lone surrogate: not text, tokenizers fail
            raise BadRequest(f"{key}[{i}]: a lone surrogate {text[e.start]!r} at character {e.start}") from None
    return value


def parse_body(data) -> tuple:
    """(prompts, completions) from a /get_reward body: each query must start with its prompt."""
    if not isinstance(data, dict):
        raise BadRequest("expected a JSON object with 'query' and 'prompts'")
    queries, prompts = texts(data, "query"), texts(data, "prompts")
    if len(queries) != len(prompts):
        raise BadRequest(f"{len(queries)} queries for {len(prompts)} prompts")
    bad = [i for i, (q, p) in enumerate(zip(queries, prompts)) if not q.startswith(p)]
    if bad:  # the split point between prompt and solution would be a guess
        raise BadRequest(f"query {bad[0]} does not start with its prompt ({len(bad)} such queries)")
    return prompts, [q[len(p):] for q, p in zip(queries, prompts)]


class Scorer:
    """The /get_reward answer to a parsed body; one request at a time on the model (its tokenizer is not safe to
    share between threads either)."""

    def __init__(self, reward: PRMReward):
        self.reward, self.lock = reward, threading.Lock()

    def __call__(self, data) -> dict:
        prompts, completions = parse_body(data)
        with self.lock:
            rewards = self.reward(prompts, completions)
        # OpenRLHF's own serve_rm answers both keys; clients read "rewards" (the default score key)
        return {"rewards": rewards, "scores": rewards}


def make_handler(scorer: Scorer, name: str, seconds: float, max_body: int):
    class Handler(BaseHTTPRequestHandler):
        timeout = seconds  # StreamRequestHandler.setup puts it on the socket: every read or write waits at most
        # this long, so an idle, slow or short-bodied client is dropped (its own thread only ever waited on it)

        def do_GET(self):
            if self.path.rstrip("/") != HEALTH:
                return self.reply(404, {"error": f"unknown path {self.path}; GET {HEALTH} or POST {PATH}"})
            self.reply(200, {"status": "ok", "model": name, "aggregate": scorer.reward.aggregate})

        def do_POST(self):
            if self.path.rstrip("/") != PATH:
                return self.reply(404, {"error": f"unknown path {self.path}; POST to {PATH}"})
            try:
                payload = scorer(read_json(self.body()))
            except BadRequest as e:
                return self.reply(e.status, {"error": str(e)})
            except Exception as e:  # a failure in scoring: this request gets a 500, the server serves on
                traceback.print_exc(file=sys.stderr)
                return self.reply(500, {"error": f"scoring failed: {type(e).__name__}: {e}"})
            self.reply(200, payload)

        def body(self) -> bytes:
            """The whole request body, within the size limit and the timeout."""
            size = body_size(self.headers.get("Content-Length"), max_body)
            try:
                body = self.rfile.read(size)
            except TimeoutError:  # fewer bytes than Content-Length said, or a client too slow
                raise BadRequest(f"the body did not arrive within {seconds} s (--timeout)", 408) from None
            if len(body) < size:  # the client closed its side early
                raise BadRequest(f"the body ended after {len(body)} of its {size} bytes (Content-Length)")
            return body

        def send_error(self, code, message=None, explain=None):
            """The standard library's own errors (unknown method, bad request line, headers too long) as JSON."""
            self.close_connection = True
            self.reply(code, {"error": message or HTTPStatus(code).phrase})

        def reply(self, status: int, payload: dict):
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


def make_server(reward: PRMReward, host: str = "127.0.0.1", port: int = 0, *, name: str = "", timeout: float = 30.0,
                max_body: int = MAX_BODY) -> ThreadingHTTPServer:
    """The server, bound and not yet serving (port 0: a free one, in server.server_port). Its threads are daemons:
    a client still connected never holds up the process's exit."""
    return ThreadingHTTPServer((host, port), make_handler(Scorer(reward), name, timeout, max_body))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a train.py output directory or any 2-label token classifier")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=5000, help="0 picks a free port (printed at start)")
    p.add_argument("--aggregate", default="min", choices=["min", "prod", "last", "mean"])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let the model directory's own Python files run (off: whatever its config files say)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a client may stay silent (idle, or sending its request) before it is dropped")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY, help="larger request bodies get a 413")
    args = p.parse_args(argv)
    if not (math.isfinite(args.timeout) and args.timeout > 0) or args.max_body_bytes < 1:
        p.error("--timeout must be a finite number of seconds > 0 and --max-body-bytes at least 1")
    reward = PRMReward(args.model, args.aggregate, args.device, args.batch_size,
                       trust_remote_code=args.trust_remote_code)
    server = make_server(reward, args.host, args.port, name=args.model, timeout=args.timeout,
                         max_body=args.max_body_bytes)
    print(f"serving {args.model} on http://{args.host}:{server.server_port}{PATH}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
