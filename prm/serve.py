"""`python -m prm.serve --model DIR --port P`: a trained PRM behind OpenRLHF's remote reward model protocol, on the
standard library's HTTP server, so `--remote_rm_url http://HOST:P/get_reward` uses it unchanged.

POST /get_reward with {"query": [full text, ...], "prompts": [prompt, ...]} (other fields, e.g. "labels", are
ignored) answers {"rewards": [...], "scores": [...]}: the reward of a query is PRMReward on (its prompt, the rest of
its text). A malformed request gets a 400 with {"error": message}; the server keeps serving.
Depends on: prm.reward."""
import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

from prm.reward import PRMReward

PATH = "/get_reward"


class BadRequest(ValueError):
    """What is wrong with a request body, sent back with a 400."""


def parse_body(body: bytes) -> tuple:
    """(prompts, completions) from a /get_reward body: each query must start with its prompt."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest("expected a JSON object with 'query' and 'prompts'")
    queries, prompts = data.get("query"), data.get("prompts")
    for key, value in (("query", queries), ("prompts", prompts)):
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise BadRequest(f"field '{key}': expected a list of strings, got {type(value).__name__}")
    if len(queries) != len(prompts):
        raise BadRequest(f"{len(queries)} queries for {len(prompts)} prompts")
    bad = [i for i, (q, p) in enumerate(zip(queries, prompts)) if not q.startswith(p)]
    if bad:  # the split point between prompt and solution would be a guess
        raise BadRequest(f"query {bad[0]} does not start with its prompt ({len(bad)} such queries)")
    return prompts, [q[len(p):] for q, p in zip(queries, prompts)]


def make_handler(reward: PRMReward):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            if self.path.rstrip("/") != PATH:
                return self.reply(404, {"error": f"unknown path {self.path}; POST to {PATH}"})
            try:
                prompts, completions = parse_body(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            except BadRequest as e:
                return self.reply(400, {"error": str(e)})
            rewards = reward(prompts, completions)
            # OpenRLHF's own serve_rm answers both keys; clients read "rewards" (the default score key)
            self.reply(200, {"rewards": rewards, "scores": rewards})

        def reply(self, status: int, payload: dict):
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


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
    args = p.parse_args(argv)
    reward = PRMReward(args.model, args.aggregate, args.device, args.batch_size,
                       trust_remote_code=args.trust_remote_code)
    # one request at a time: the model is not shared between threads
    server = HTTPServer((args.host, args.port), make_handler(reward))
    print(f"serving {args.model} on http://{args.host}:{server.server_port}{PATH}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
