"""`python -m prm.serve --model DIR --port P`: a trained PRM behind OpenRLHF's remote reward model protocol, on the
standard library's HTTP server, so `--remote_rm_url http://HOST:P/get_reward` uses it unchanged.

POST /get_reward with {"query": [full text, ...], "prompts": [prompt, ...]} (other fields, e.g. "labels", are
ignored) answers {"rewards": [...], "scores": [...], "extra_logs": {"steps": [...], "steps_scored": [...]}}: the
reward of a query is PRMReward on (its prompt, the rest of its text); steps counts the steps of each completion,
steps_scored those that fit in the model's max length. Queries and prompts first lose the tokenizer's padding and
EOS at both ends and its BOS at the start, as OpenRLHF's own server does (the prompt's tokenization adds BOS back).
Without "prompts", a query's prompt is all up to the last assistant turn's start in the tokenizer's chat template
(e.g. "<|im_start|>assistant\\n"); with no template or no such marker in it, the text before the first step
separator (a query without one is all prompt: reward 0.0). GET /health answers {"status": "ok", ...}.

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

from prm.errors import exit_status
from prm.reward import PRMReward
from prm.scorers import FAMILIES

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
    if not isinstance(value, list):
        raise BadRequest(f"field '{key}': expected a list of strings, got {type(value).__name__}")
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise BadRequest(f"field '{key}': item {i} is {type(text).__name__}, not a string")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's "\ud800" decodes to a lone surrogate: not text, tokenizers fail
            raise BadRequest(f"field '{key}': item {i} holds a lone surrogate {text[e.start]!r} at character "
                             f"{e.start}") from None
    return value


def strip_tokens(text: str, left: list, right: list) -> str:
    """text without any run of the `left` tokens at its start and of the `right` ones at its end (linear time:
    indices move, the text is cut once)."""
    start, end = 0, len(text)
    while tok := next((t for t in left if text.startswith(t, start, end)), ""):
        start += len(tok)
    while tok := next((t for t in right if text.endswith(t, start, end)), ""):
        end -= len(tok)
    return text[start:end]


def assistant_marker(tokenizer) -> str:
    """What the chat template writes to open the assistant's turn ("<|im_start|>assistant\\n" in Qwen's); "" when
    there is no template or it writes nothing there."""
    if not getattr(tokenizer, "chat_template", None):
        return ""
    turn = [{"role": "user", "content": "q"}]
    try:
        closed, opened = (tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=g)
                          for g in (False, True))
    except Exception:  # a template that refuses a lone user message (it raises through Jinja): no marker
        return ""
    return opened[len(closed):] if opened.startswith(closed) else ""


def split_query(query: str, marker: str, separator: str) -> tuple:
    """(prompt, completion) of a query sent without its prompt: the prompt ends with the last assistant-turn
    marker, or without one before the first step separator (the whole query, with no separator: no steps)."""
    if marker and marker in query:
        cut = query.rindex(marker) + len(marker)
    else:
        cut = query.find(separator) if separator in query else len(query)
    return query[:cut], query[cut:]


class Scorer:
    """The /get_reward answer to a parsed body; one request at a time on the model (its tokenizer is not safe to
    share between threads either)."""

    def __init__(self, reward: PRMReward):
        self.reward, self.lock = reward, threading.Lock()
        tok = reward.tokenizer
        self.marker = assistant_marker(tok)
        # decoded rollouts keep their left padding and their EOS and right padding: OpenRLHF's own server strips
        # both; a BOS goes too, since the prompt's tokenization puts the tokenizer's own back (prm.data.with_bos)
        self.right = [t for t in (tok.pad_token, tok.eos_token) if t]
        self.left = self.right + [t for t in (tok.bos_token,) if t]

    def split(self, data) -> tuple:
        """(prompts, completions) of a /get_reward body, every text stripped of padding, EOS and BOS."""
        if not isinstance(data, dict):
            raise BadRequest("expected a JSON object with 'query' (and 'prompts')")
        queries = [strip_tokens(q, self.left, self.right) for q in texts(data, "query")]
        if data.get("prompts") is None:  # OpenRLHF always sends them; other clients may not
            pairs = [split_query(q, self.marker, self.reward.step_separator) for q in queries]
            return [p for p, _ in pairs], [c for _, c in pairs]
        prompts = [strip_tokens(p, self.left, self.right) for p in texts(data, "prompts")]
        if len(queries) != len(prompts):
            raise BadRequest(f"{len(queries)} queries for {len(prompts)} prompts")
        bad = [i for i, (q, p) in enumerate(zip(queries, prompts)) if not q.startswith(p)]
        if bad:  # the split point between prompt and solution would be a guess
            raise BadRequest(f"query {bad[0]} does not start with its prompt ({len(bad)} such queries)")
        return prompts, [q[len(p):] for q, p in zip(queries, prompts)]

    def __call__(self, data) -> dict:
        prompts, completions = self.split(data)
        with self.lock:
            probs = self.reward.step_probs(prompts, completions)
        rewards = self.reward.aggregated(probs)
        # OpenRLHF's own serve_rm answers these keys; clients read "rewards" (the default score key) and log each
        # extra_logs list (one value per query): the steps of each completion, and those that fit and were scored
        return {"rewards": rewards, "scores": rewards,
                "extra_logs": {"steps": [len(self.reward.steps(c)) for c in completions],
                               "steps_scored": [len(ps) for ps in probs]}}


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
                   help="seconds a client may stay silent (idle, or sending its request) before it is dropped "
                        "(default: %(default)s)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY,
                   help="larger request bodies get a 413 (default: %(default)s, 8 MiB)")
    p.add_argument("--scorer", choices=("auto",) + FAMILIES, default="auto",
                   help="how the model scores steps (eval.py --help); --step-tag, --good-token, --bad-token too")
    for flag, default in (("--step-tag", ""), ("--good-token", "+"), ("--bad-token", "-")):
        p.add_argument(flag, default=default, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not (math.isfinite(args.timeout) and args.timeout > 0) or args.max_body_bytes < 1:
        p.error("--timeout must be a finite number of seconds > 0 and --max-body-bytes at least 1")
    with exit_status():  # a bad scorer setting: one line and exit status 2
        reward = PRMReward(args.model, args.aggregate, args.device, args.batch_size,
                           trust_remote_code=args.trust_remote_code, scorer=args.scorer,
                           step_tag=args.step_tag, good_token=args.good_token, bad_token=args.bad_token)
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
    with exit_status():  # a model directory that cannot be loaded: one line and exit status 2
        main()
