"""prm.serve: OpenRLHF's request and answer shapes (padded and EOS-ended queries; prompts required); under bad clients:
idle and slow ones held open while 8 others are answered, every malformed request a JSON 4xx, a scoring failure a
500, each followed by a good answer. In-process servers on free ports. Depends on: pytest, prm."""
import contextlib
import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from prm.readers.formats import split_steps
from prm import serve
from prm.scoring.reward import PRMReward

PROMPTS = ["count from 1:", "count from 7:", "count from 3:"]
COMPLETIONS = ["1+1=2\n2+1=3\n3+1=4\n", "7+1=8\n8+1=0", "3+1=5"]
GOOD = {"query": [p + c for p, c in zip(PROMPTS, COMPLETIONS)], "prompts": PROMPTS, "labels": ["4", "0", "4"]}
LIMIT = 1 << 20  # the test servers' --max-body-bytes: room for the deeply nested body
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # Qwen's, in short


@pytest.fixture(scope="module")
def reward(model_dir):
    return PRMReward(model_dir, device="cpu")


@pytest.fixture(scope="module")
def expected(reward):
    return reward(PROMPTS, COMPLETIONS)


@contextlib.contextmanager
def running(reward, timeout: float, **limits):
    opts = serve.ServeOptions(model="tiny", port=0, timeout=timeout, max_body_bytes=LIMIT, **limits)
    server = serve.make_server(reward, opts)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture(scope="module")
def port(reward):
    with running(reward, timeout=2.0) as p:  # short: a client the server drops costs the suite 2 s
        yield p


def request(port, method: str = "POST", path: str = serve.PATH, body=None) -> tuple:
    """(status, JSON answer) of a well-formed request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode())
        r = conn.getresponse()
        assert r.getheader("Content-Type") == "application/json"  # errors too: never the stdlib's HTML page
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def raw(port, length, body: bytes = b"", close_early: bool = False) -> tuple:
    """(status, JSON answer) of a hand-written POST: Content-Length as given (None: none), then body."""
    head = f"POST {serve.PATH} HTTP/1.1\r\nHost: x\r\n" + (f"Content-Length: {length}\r\n" if length is not None
                                                            else "")
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(head.encode() + b"\r\n" + body)
        if close_early:  # the client says it is done before Content-Length bytes came
            s.shutdown(socket.SHUT_WR)
        return parse_reply(read_all(s))


def read_all(s) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def parse_reply(data: bytes) -> tuple:
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def assert_served(port, expected):
    status, out = request(port, body=GOOD)
    assert status == 200 and out["rewards"] == out["scores"] == pytest.approx(expected, abs=1e-6), out


def waiting(s) -> bool:
    """Whether the server still holds this connection open without having answered it."""
    s.setblocking(False)
    try:
        return s.recv(1, socket.MSG_PEEK) is None  # b"": closed; a byte: answered
    except BlockingIOError:
        return True
    finally:
        s.setblocking(True)


def test_idle_and_slow_clients_do_not_stop_the_others(reward, expected):
    with running(reward, timeout=4.0) as port:  # the 8 take ~0.2 s: 4 s leaves a loaded machine room
        idle = socket.create_connection(("127.0.0.1", port))  # connects, sends nothing
        slow = socket.create_connection(("127.0.0.1", port))  # says 1000 bytes, sends 10
        slow.sendall(f"POST {serve.PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n".encode() + b"[" * 10)
        try:
            time.sleep(0.3)  # both accepted and read from: a one-at-a-time server would be stuck on the first
            start = time.monotonic()
            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(lambda _: request(port, body=GOOD), range(8)))
            took = time.monotonic() - start
            assert waiting(idle) and waiting(slow)  # answered while those two were still connected
            assert took < 20 and all(status == 200 for status, _ in answers), (took, answers)
            assert all(out["rewards"] == pytest.approx(expected, abs=1e-6) for _, out in answers)
            idle.settimeout(15)
            slow.settimeout(15)
            assert read_all(idle) == b""  # dropped after --timeout without a word: it never asked anything
            status, out = parse_reply(read_all(slow))
            assert status == 408 and "--timeout" in out["error"]
        finally:
            idle.close()
            slow.close()


@pytest.mark.parametrize("length, body, status, message", [
    (None, b"", 411, "Content-Length is required"),
    ("abc", b"", 400, "expected a number of bytes"),
    ("-5", b"", 400, "expected a number of bytes"),
    (str(2 * LIMIT), b"", 413, "--max-body-bytes"),  # refused from the header: the body is never sent
    ("9" * 5000, b"", 413, "over --max-body-bytes"),  # too many digits for int() to read
    (9, b"{not json", 400, "the body line 1: malformed JSON: Expecting property name"),
    (2, b"\xff\xfe", 400, "the body line 1: not UTF-8 text (byte 0xff at offset 0)"),
    (100000, b"[" * 100000, 400, "the body: malformed JSON: nested too deeply"),
    (5001, b"1" * 5001, 400, "the body: unreadable JSON: Exceeds the limit (4300 digits)"),
    (1325, b'{"query": ' + b"[" * 650 + rb'"\ud83d\ude00"' + b"]" * 650 + b"}", 400,  # as deep as json reads,
     "field 'query': item 0 is list, not a string"),  # and an escape that has every string checked for surrogates
    (29, b'{"query": ["a"], "query": []}', 400, "the body: field 'query': given twice"),
])
def test_malformed_requests_get_a_json_4xx_and_the_server_serves_on(port, expected, length, body, status, message):
    got, out = raw(port, length, body)
    assert got == status and message in out["error"], out
    assert_served(port, expected)


@pytest.mark.parametrize("body, message", [
    ({**GOOD, "query": ["count from 1:\ud800"], "prompts": ["count from 1:"]},
     "the body: field 'query[0]': a lone UTF-16 surrogate '\\ud800' at 13"),
    ({**GOOD, "query": "count from 1:"}, "field 'query'"),
    ({**GOOD, "prompts": ["count from 1:", 2, 3]}, "field 'prompts': item 1 is int, not a string"),
    ([GOOD], "expected a JSON object"),
    ({**GOOD, "prompts": PROMPTS[:2]}, "3 queries for 2 prompts"),
    ({**GOOD, "prompts": ["x:"] * 3}, "query 0 does not start with its prompt (3 such queries)"),
    ({**GOOD, "step_rewards": "yes"}, "field 'step_rewards': expected true or false, got 'yes'"),
])
def test_wrong_fields_get_a_400(port, body, message):
    status, out = request(port, body=body)  # json.dumps writes the surrogate as the escape "\ud800"
    assert status == 400 and message in out["error"], out


def test_two_different_content_lengths_get_a_400(port, expected):
    body = json.dumps(GOOD).encode()
    got, out = raw(port, f"{len(body)}\r\nContent-Length: {len(body) - 1}", body)
    assert got == 400 and out["error"] == "2 different Content-Length headers", out
    assert raw(port, f"{len(body)}\r\nContent-Length: {len(body)}", body)[0] == 200  # the same length twice: fine
    assert_served(port, expected)


def test_more_queries_than_max_batch_get_a_413(reward, expected):
    with running(reward, timeout=5.0, max_batch=3) as port:
        status, out = request(port, body={"query": GOOD["query"] * 2, "prompts": PROMPTS * 2})
        assert status == 413 and "6 queries: over --max-batch 3" in out["error"], out
        assert_served(port, expected)  # 3 queries: within it


def test_slow_clients_get_one_deadline_and_beyond_max_connections_a_503(reward, expected):
    """20 clients each sending one header byte every 0.5 s (each read well within --timeout 2): 4 are served and
    cut off at the request's deadline with a 408, the other 16 get a 503 at once; the server's threads stay few."""
    base = threading.active_count()
    with running(reward, timeout=2.0, max_connections=4) as port:
        socks = [socket.create_connection(("127.0.0.1", port), timeout=20) for _ in range(20)]
        line, answers, most = f"POST {serve.PATH} HTTP/1.1\r\n".encode() * 10, {}, 0
        for byte in range(len(line)):  # a client gets 40 chances before it stops by itself: 20 s at most
            for i, s in enumerate(socks):
                if i not in answers and not waiting(s):
                    with contextlib.suppress(ConnectionResetError):  # a byte sent after the cut may reset it
                        answers[i] = "cut"
                        answers[i] = parse_reply(read_all(s))[0]
                elif i not in answers:
                    with contextlib.suppress(OSError):
                        s.sendall(line[byte:byte + 1])
            most = max(most, threading.active_count() - base)
            if len(answers) == 20 or byte == 40:
                break
            time.sleep(0.5)
        for s in socks:
            s.close()
        statuses = list(answers.values())  # all 20 answered before their 40 bytes were sent
        assert len(statuses) == 20 and statuses.count(503) == 16 and set(statuses) - {503} <= {408, "cut"}, answers
        assert most <= 1 + 2 * 4  # serve_forever, and a handler and its deadline timer per connection served
        assert_served(port, expected)


def test_a_connections_deadline_takes_no_thread_beside_its_handler(reward):
    """3 clients connected, sending nothing: serve_forever and one handler each, however long they stay."""
    base = threading.active_count()
    with running(reward, timeout=60.0) as port:
        socks = [socket.create_connection(("127.0.0.1", port), timeout=20) for _ in range(3)]
        try:
            for _ in range(300):  # until the three are accepted (their handlers start)
                if threading.active_count() - base >= 4:
                    break
                time.sleep(0.1)
            counts = []
            for _ in range(10):  # a while longer: no thread joins them
                counts.append(threading.active_count() - base)
                time.sleep(0.1)
            assert max(counts) == 1 + 3, counts
        finally:
            for s in socks:
                s.close()


@pytest.mark.parametrize("method, path, allowed", [("GET", serve.PATH, "POST"), ("POST", serve.HEALTH, "GET")])
def test_a_known_path_asked_with_the_other_method_gets_a_405_naming_the_allowed_one(port, method, path, allowed):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request(method, path, body=json.dumps(GOOD).encode() if method == "POST" else None)
        r = conn.getresponse()
        assert (r.status, r.getheader("Allow")) == (405, allowed)
        assert f"{method} {path}: " in json.loads(r.read())["error"]
    finally:
        conn.close()


def test_a_body_shorter_than_its_length_is_refused(port):
    assert raw(port, 1000, b"[" * 10, close_early=True) == (400, {"error": "the body ended after 10 of its 1000 "
                                                                           "bytes (Content-Length)"})


def test_health_other_paths_and_methods_answer_json(port, model_dir):
    assert request(port, "GET", "/health") == (200, {"status": "ok", "model": "tiny", "aggregate": "min"})
    status, out = request(port, "GET", "/")
    assert status == 404 and "GET /health" in out["error"]
    status, out = request(port, "POST", "/other", GOOD)
    assert status == 404 and "POST to /get_reward" in out["error"]
    status, out = request(port, "PUT")
    assert status == 501 and "PUT" in out["error"]


def test_a_failure_while_scoring_is_a_500_and_the_next_request_is_served(port, reward, expected, monkeypatch,
                                                                          capsys):
    def broken(*a, **kw):
        raise RuntimeError("CUDA out of memory")
    monkeypatch.setattr(reward, "step_scores", broken)
    assert request(port, body=GOOD) == (500, {"error": "scoring failed: RuntimeError: CUDA out of memory"})
    assert "Traceback" in capsys.readouterr().err  # the server's log says where
    monkeypatch.undo()
    assert_served(port, expected)


def test_openrlhf_requests_and_answers(port, expected):
    # what OpenRLHF's remote_rm_fn posts: decoded rollouts (left padding, BOS, EOS, right padding), prompts, labels
    body = {"query": ["<pad><pad><bos>" + q + "<eos><pad>" for q in GOOD["query"]],
            "prompts": ["<bos>" + p for p in PROMPTS], "labels": GOOD["labels"]}
    status, out = request(port, body=body)
    assert status == 200 and set(out) == {"rewards", "scores", "extra_logs"}
    assert out["rewards"] == out["scores"] == pytest.approx(expected, abs=1e-6)  # scored as the bare texts
    assert out["extra_logs"] == {"steps": [3, 2, 1], "steps_scored": [3, 2, 1]}
    # a query alone: no prompt guessed
    status, out = request(port, body={"query": GOOD["query"]})
    assert (status, out) == (400, {"error": "field 'prompts': expected a list of strings, got nothing"})


def test_a_prompt_rendered_by_the_models_template_is_scored_as_its_messages(model_dir):
    """OpenRLHF sends the rendered chat prompt: one user turn in the PRM's own template is scored as training
    scored the message (the template writes no BOS; the character tokenizer has one, the text alone gained it)."""
    reward = PRMReward(model_dir, device="cpu")
    reward.tokenizer.chat_template = TEMPLATE
    chat = [{"role": "user", "content": "count from 1:"}]
    prompt = reward.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    scorer = serve.Scorer(reward)
    assert scorer.split({"query": [prompt + "1+1=2\n"], "prompts": [prompt]}) == ([chat], ["1+1=2\n"])
    out = scorer({"query": [prompt + "1+1=2\n"], "prompts": [prompt]})
    assert out["rewards"] == pytest.approx(reward([chat], ["1+1=2\n"]), abs=1e-6)
    assert out["rewards"] != pytest.approx(reward([prompt], ["1+1=2\n"]), abs=1e-6)  # the BOS mattered


def test_step_rewards_give_each_steps_span_in_the_query_as_sent_and_its_score(reward, port):
    queries = ["<pad><bos>" + q + "<eos><pad>" for q in GOOD["query"]]
    status, out = request(port, body={**GOOD, "query": queries, "step_rewards": True})
    assert status == 200 and len(out["step_rewards"]) == 3
    for query, completion, got, want in zip(queries, COMPLETIONS, out["step_rewards"],
                                            reward.step_scores(PROMPTS, COMPLETIONS)):
        assert [query[a:b] for a, b, _ in got] == split_steps(completion, "\n")
        assert [p for *_, p in got] == pytest.approx([p for *_, p in want], abs=1e-6)
    cut = serve.Scorer(PRMReward(reward.model, tokenizer=reward.tokenizer, device="cpu", max_length=25))
    with pytest.warns(UserWarning, match="2 of 3 completions truncated"):
        out = cut({**GOOD, "step_rewards": True})
    assert [[p is None for *_, p in steps] for steps in out["step_rewards"]] == [[False, True, True], [False, True],
                                                                               [False]]


@pytest.mark.parametrize("step_rewards", [{}, {"step_rewards": False}])
def test_a_request_without_step_rewards_is_answered_as_before(port, expected, step_rewards):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("POST", serve.PATH, body=json.dumps({**GOOD, **step_rewards}).encode())
        body = conn.getresponse().read()
    finally:
        conn.close()
    assert body == json.dumps({"rewards": expected, "scores": expected,
                               "extra_logs": {"steps": [3, 2, 1], "steps_scored": [3, 2, 1]}}).encode()


def test_extra_logs_count_the_steps_cut_by_the_max_length(model_dir):
    # 14 prompt tokens (BOS + 13 characters) + 6 per step: one step fits in 25 tokens
    out = serve.Scorer(PRMReward(model_dir, device="cpu", max_length=25))(GOOD)
    assert out["extra_logs"] == {"steps": [3, 2, 1], "steps_scored": [1, 1, 1]}


def test_a_query_of_many_tiny_steps_tokenizes_only_the_steps_that_fit(reward, monkeypatch):
    """A request's work is bounded by --max-length x --max-batch, not by its body: steps past the
    length budget are never tokenized (an 8 MB body of "a\\n" held the model for half a minute)."""
    from prm.core import evaluate
    tokenized, tokenize = [], evaluate.tokenize_batch

    def counting(batch, *args, **kwargs):
        tokenized.extend(map(len, batch["completions"]))
        return tokenize(batch, *args, **kwargs)
    monkeypatch.setattr(evaluate, "tokenize_batch", counting)
    cut = serve.Scorer(PRMReward(reward.model, tokenizer=reward.tokenizer, device="cpu",
                                 max_length=40))
    with pytest.warns(UserWarning, match="2 of 2 completions truncated"):
        out = cut({"query": ["q:\n" + "a\n" * 5000] * 2, "prompts": ["q:"] * 2})
    assert tokenized == [40, 40]  # steps handed to the tokenizer per query: not 5,000
    with pytest.warns(UserWarning, match="1 of 1 completions truncated"):
        fits = cut.reward(["q:"], ["\n" + "a\n" * 40])  # the same steps scored: only cut ones lost
    assert out["rewards"] == pytest.approx(fits * 2, abs=1e-6)
    assert out["extra_logs"]["steps"] == [5000, 5000]


def test_step_separator_max_length_and_dtype_flags_reach_the_reward(model_dir, monkeypatch, capsys):
    served = []

    def no_server(reward, *args, **kwargs):  # the settings are all that is checked: nothing is bound
        served.append(reward)
        raise OSError("not bound")
    monkeypatch.setattr(serve, "make_server", no_server)
    monkeypatch.setenv("PRM_CPU_BF16", "1")  # a bf16-native CPU: the default is bf16, as eval.py's
    for flags in ([], ["--step-separator", "\\n\\n", "--max-length", "25", "--dtype", "fp32"]):
        with pytest.raises(SystemExit):
            serve.main(["--model", model_dir, "--device", "cpu"] + flags)
    assert served[0].amp_dtype == torch.bfloat16
    assert (served[1].step_separator, served[1].max_length) == ("\n\n", 25)
    assert served[1].amp_dtype is None
    for flags in (["--max-length", "0"], ["--step-separator", ""]):
        with pytest.raises(SystemExit) as e:
            serve.main(["--model", model_dir] + flags)
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and last.startswith(f"error: {flags[0]} ") and ": must" in last


@pytest.mark.parametrize("flag", ["--bogus", "--max-conn"])  # no prefix abbreviations either
def test_a_bad_flag_is_one_line_and_exit_status_2(flag, capsys):
    with pytest.raises(SystemExit) as e:
        serve.main(["--model", "never-loaded", flag, "3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: unrecognized arguments: {flag} 3") and err.count("\n") == 1


@pytest.mark.parametrize("flags, message", [(["--port", "99999"], "--port 99999: must be in [0, 6"),
                                            (["--port", "-1"], "--port -1: must be in [0, 65535]"),
                                            (["--device", "cuda:99"], "--device cuda:99: ")])
def test_a_bad_port_or_device_is_one_line_and_exit_status_2_before_the_model_loads(flags, message,
                                                                                   capsys):
    with pytest.raises(SystemExit) as e:
        serve.main(["--model", "never-loaded"] + flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize("flags, message", [(["--host", "127.0.0.1"], "cannot listen on 127.0.0.1:"),
                                            (["--batch-size", "0"], "--batch-size 0: must be >= 1")])
def test_a_busy_port_or_a_bad_batch_size_is_one_line_and_exit_status_2(model_dir, flags, message):
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cmd = [sys.executable, "-m", "prm.serve", "--model", model_dir, "--device", "cpu",
               "--port", str(busy.getsockname()[1])] + flags
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]  # after transformers' progress bars, if any
    assert message in last and last.startswith(("error: ", "serve.py: error: ")), proc.stderr
