"""`python -m prm.serve`: a PRM behind OpenRLHF's remote reward model protocol (POST /get_reward;
"step_rewards": true adds [start, end, P(correct)] per step of each query; GET /health)."""
import contextlib
import io
import json
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from prm.cli import Parser, parsed
from prm.config import FINITE, Checked, at_least, bound, not_empty, opt, unescape, within
from prm.errors import UsageError, exit_status
from prm.readers.formats import decode, read_json
from prm.scoring import ScorerOptions
from prm.scoring.reward import PRMReward

PATH, HEALTH = "/get_reward", "/health"
PROBE = "\x00question\x00"  # no chat template rewrites it, no prompt holds it
BUSY = b'{"error": "too many connections (--max-connections); try again"}'
BUSY = b"HTTP/1.0 503 Busy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(BUSY), BUSY)


def parse(body: bytes):
    text, problem, line = decode(body)
    if text is not None:
        value, problem, line = read_json(text)
    if problem:
        raise BadRequest(f"the body{f' line {line}' if line else ''}: {problem}")
    return value


class BadRequest(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def texts(data: dict, key: str) -> list:
    value = data.get(key)
    if not isinstance(value, list):
        got = "nothing" if value is None else type(value).__name__
        raise BadRequest(f"field '{key}': expected a list of strings, got {got}")
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise BadRequest(f"field '{key}': item {i} is {type(text).__name__}, not a string")
    return value


def strip_tokens(text: str, left: list, right: list) -> str:
    """text without its runs of `left` tokens at the start and `right` ones at the end."""
    start, end = 0, len(text)
    while tok := next((t for t in left if text.startswith(t, start, end)), ""):
        start += len(tok)
    while tok := next((t for t in right if text.endswith(t, start, end)), ""):
        end -= len(tok)
    return text[start:end]


class Scorer:
    def __init__(self, reward: PRMReward, max_batch: int = 1024):
        self.reward, self.max_batch, self.lock = reward, max_batch, threading.Lock()
        tok = reward.tokenizer
        self.right = [t for t in (tok.pad_token, tok.eos_token) if t]
        self.left = self.right + [t for t in (tok.bos_token,) if t]
        probe = self.turn(PROBE)
        self.frame = tuple(probe.split(PROBE)) if probe.count(PROBE) == 1 else (PROBE, "")

    def turn(self, text: str) -> str:
        """text as one user turn in the chat template; "" if none."""
        try:
            text = self.reward.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        except Exception:  # no template, or one refusing a lone user message
            return ""
        return strip_tokens(text, self.left, self.right)

    def question(self, prompt: str):
        """A prompt that is one user turn in the chat template, as that turn."""
        head, tail = self.frame
        if not (prompt.startswith(head) and prompt.endswith(tail)):
            return prompt
        text = prompt[len(head):len(prompt) - len(tail)]
        if self.turn(text) != prompt or any(end and end in text for end in self.frame):
            return prompt
        return text if self.reward.tokenize else [{"role": "user", "content": text}]

    def split(self, data) -> tuple:
        """(prompts, completions) of a body, without padding, EOS and BOS."""
        if not isinstance(data, dict):
            raise BadRequest("expected a JSON object with 'query' and 'prompts'")
        queries = texts(data, "query")
        if len(queries) > self.max_batch:
            raise BadRequest(f"{len(queries)} queries: over --max-batch {self.max_batch}", 413)
        queries = [strip_tokens(q, self.left, self.right) for q in queries]
        prompts = [strip_tokens(p, self.left, self.right) for p in texts(data, "prompts")]
        if len(queries) != len(prompts):
            raise BadRequest(f"{len(queries)} queries for {len(prompts)} prompts")
        bad = [i for i, (q, p) in enumerate(zip(queries, prompts)) if not q.startswith(p)]
        if bad:
            raise BadRequest(f"query {bad[0]} does not start with its prompt "
                             f"({len(bad)} such queries)")
        completions = [q[len(p):] for q, p in zip(queries, prompts)]
        return [self.question(p) for p in prompts], completions

    def __call__(self, data) -> dict:
        prompts, completions = self.split(data)
        if not isinstance(data.get("step_rewards", False), bool):
            raise BadRequest("field 'step_rewards': expected true or false, "
                             f"got {data['step_rewards']!r:.40}")
        with self.lock:
            scores = self.reward.step_scores(prompts, completions)
        probs = [[p for *_, p in steps if p is not None] for steps in scores]
        rewards = self.reward.aggregated(probs)
        logs = {"steps": [len(steps) for steps in scores], "steps_scored": [len(p) for p in probs]}
        out = {"rewards": rewards, "scores": rewards, "extra_logs": logs}  # serve_rm's keys
        if data.get("step_rewards"):  # offsets in the query as sent
            ends = [len(strip_tokens(q, [], self.right)) - len(c)
                    for q, c in zip(data["query"], completions)]
            out["step_rewards"] = [[[a + at, b + at, p] for a, b, p in steps]
                                   for steps, at in zip(scores, ends)]
        return out


class Deadline(socket.SocketIO):
    """A connection's reading side: EOF (and `expired`) `timeout` s after connecting."""

    def __init__(self, handler):
        super().__init__(handler.connection, "rb")
        self.handler, self.end = handler, time.monotonic() + handler.timeout

    def readinto(self, buffer):
        left = self.end - time.monotonic()
        if left > 0 and not self.handler.expired:
            self.handler.connection.settimeout(left)
            with contextlib.suppress(TimeoutError):
                return super().readinto(buffer)
        self.handler.expired = True
        return 0


class Handler(BaseHTTPRequestHandler):
    """make_server sets scorer, opts (ServeOptions), timeout."""
    expired = False
    default_request_version = "HTTP/1.0"  # an answer to a cut request line has a status line

    def setup(self):
        super().setup()
        self.rfile.close()
        self.rfile = io.BufferedReader(Deadline(self))

    def known(self, path: str, other: str, allow: str) -> bool:
        at = self.path.rstrip("/")
        if at == other:
            self.reply(405, {"error": f"{self.command} {other}: use {allow}"}, allow=allow)
        elif at != path:
            self.reply(404, {"error": f"unknown path {self.path}; GET {HEALTH} or POST to {PATH}"})
        return at == path

    def do_GET(self):
        if self.known(HEALTH, PATH, "POST"):
            self.reply(200, {"status": "ok", "model": self.opts.model,
                             "aggregate": self.scorer.reward.aggregate})

    def do_POST(self):
        if not self.known(PATH, HEALTH, "GET"):
            return
        try:
            payload = self.scorer(parse(self.body()))
        except BadRequest as e:
            return self.send_error(e.status, str(e))
        except Exception as e:  # the server serves on
            traceback.print_exc(file=sys.stderr)
            return self.reply(500, {"error": f"scoring failed: {type(e).__name__}: {e}"})
        self.reply(200, payload)

    def body(self) -> bytes:
        headers, limit = self.headers.get_all("Content-Length"), self.opts.max_body_bytes
        if not headers:
            raise BadRequest("Content-Length is required", 411)
        if len({h.strip() for h in headers}) > 1:
            raise BadRequest(f"{len(headers)} different Content-Length headers")
        digits = headers[0].strip()
        # int() takes '-5', '1_0', non-ASCII digits
        if not (digits.isascii() and digits.isdigit()):
            raise BadRequest(f"Content-Length {digits[:40]!r}: expected a number of bytes")
        if len(digits.lstrip("0")) > 18 or int(digits) > limit:
            raise BadRequest(f"a body of {digits[:40]} bytes: over --max-body-bytes {limit}", 413)
        body = self.rfile.read(int(digits))
        if len(body) < int(digits):  # send_error answers a 408 if the deadline cut it
            raise BadRequest(f"the body ended after {len(body)} of its {digits} bytes "
                             "(Content-Length)")
        return body

    def send_error(self, code, message=None, explain=None):
        """Every error as JSON; one the deadline caused: a 408."""
        self.close_connection = True
        if self.expired:
            code, message = 408, f"the request took over {self.timeout} s (--timeout)"
        self.reply(code, {"error": message or HTTPStatus(code).phrase})

    def reply(self, status: int, payload: dict, *, allow: str = ""):
        body = json.dumps(payload).encode()
        self.connection.settimeout(self.timeout)  # the deadline may have shortened it
        self.send_response(status)
        if allow:
            self.send_header("Allow", allow)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Server(ThreadingHTTPServer):
    """A thread per connection, up to `slots`; one more gets a 503."""
    request_queue_size = 128

    def process_request(self, request, client_address):
        if self.slots.acquire(blocking=False):
            return super().process_request(request, client_address)
        with contextlib.suppress(OSError):
            request.sendall(BUSY)
        self.shutdown_request(request)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def make_server(reward: PRMReward, opts):
    """The server on opts (ServeOptions), bound, not yet serving."""
    attrs = {"scorer": Scorer(reward, opts.max_batch), "opts": opts, "timeout": opts.timeout}
    server = Server((opts.host, opts.port), type("Handler", (Handler,), attrs))
    server.slots = threading.BoundedSemaphore(opts.max_connections)
    return server


@dataclass
class ServeOptions(Checked):
    model: str = opt("", "a train.py output or any 2-label token classifier", required=True)
    host: str = opt("127.0.0.1", "address to bind")
    port: int = opt(5000, "0: a free one", check=within(0, 65535))
    aggregate: str = opt("min", "a solution's score from its step scores",
                         choices=["min", "prod", "last", "mean"])
    batch_size: int = opt(16, "texts per forward pass", check=at_least(1))
    step_separator: str = opt(None, "what ends each step (default: the model's own)", type=unescape,
                              check=not_empty("its last token carries the step's score"))
    max_length: int = opt(None, "tokens per text (default: the model's own)", check=at_least(1))
    device: str = opt(None, "default: cuda if available, else cpu")
    dtype: str = opt(None, "autocast (default: the run's, else auto)",
                     choices=["auto", "fp32", "bf16", "fp16"])
    trust_remote_code: bool = opt(False, "allow the model's own code")
    timeout: float = opt(30.0, "seconds to send a whole request; then a 408",
                         check=FINITE + bound(lambda v: v > 0, "must be > 0"))
    max_body_bytes: int = opt(8 << 20, "larger request bodies get a 413", check=at_least(1))
    max_batch: int = opt(1024, "more queries per request get a 413", check=at_least(1))
    max_connections: int = opt(64, "more connections at once get a 503", check=at_least(1))


def main(argv=None):
    with exit_status():
        a = Parser(ServeOptions, ScorerOptions, prog="python -m prm.serve",
                   description=__doc__).parse_args(argv)
        opts = parsed(ServeOptions, a)
        try:
            torch.empty(0, device=a.device)
        except (RuntimeError, AssertionError) as e:
            raise UsageError(f"--device {a.device}: {str(e).strip().splitlines()[0]}") from None
        reward = PRMReward(a.model, a.aggregate, a.device, a.batch_size,
                           step_separator=a.step_separator, max_length=a.max_length,
                           trust_remote_code=a.trust_remote_code, dtype=a.dtype,
                           **vars(parsed(ScorerOptions, a)))
        try:
            server = make_server(reward, opts)
        except OSError as e:
            raise UsageError(f"cannot listen on {a.host}:{a.port}: {e.strerror or e}") from None
        print(f"serving {a.model} on http://{a.host}:{server.server_port}{PATH}", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            print("stopped", file=sys.stderr)
        finally:
            server.server_close()


if __name__ == "__main__":
    main()
