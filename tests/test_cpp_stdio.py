"""cellcache_runner --stdio: JSON lines in, JSON lines out, over the on-device
engine (cpp/apps/stdio_server.h).

Oracles: the Python Runner (greedy tokens of a request equal Runner.generate's
of the same prompt, both with the prefix cache on; logprobs equal a log-softmax
of Runner.step's raw logits), each request run alone (interleaving changes
nothing), the batch mode of the same binary (same seed, same sampled tokens),
and counts derived from the requests themselves (usage, cached tokens of a
conversation's next turn). Bad input must give one error line for that line
alone and leave the server serving; end of input finishes what was accepted
and exits 0.

The default model is exported once per session (conftest.py: 512 cells, 32
tokens per step). The runner is $CELLCACHE_RUNNER when set (a build of one's
own), else `python -m executorch_cellcache runner-path`.
"""

import json
import math
import re
import subprocess

import pytest

import executorch_cellcache as ecc
from executorch_cellcache.exporting.default_model import CHECKPOINT
from executorch_cellcache.runtime.tokenizer import HFTokenizer
from stdio_support import TIMEOUT, finishes_of, run_all, sessions, tokens_of

pytestmark = pytest.mark.slow

CELLS = 512
VOCAB = 1024   # the default model's vocabulary
BOS = 0        # the default model's <s>


@pytest.fixture(scope="module")
def pte(default_pte):
    return default_pte


@pytest.fixture(scope="module")
def prompts(default_prompts):
    return default_prompts


@pytest.fixture
def session(runner_exe, pte):
    with sessions(runner_exe, pte) as open_session:
        yield open_session


def errors_of(answers):
    return [a for a in answers if "error" in a]


def assert_no_cell_leaked(stderr):
    """At exit every cell still held is the prefix cache's (the summary line)."""
    m = re.search(r"(\d+) cells held at exit, (\d+) of them by the prefix cache", stderr)
    assert m, stderr
    assert m.group(1) == m.group(2), stderr


def request(rid, prompt, max_new_tokens=16, **fields):
    return {"id": rid, "prompt": list(prompt), "max_new_tokens": max_new_tokens, **fields}


# ---------------------------------------------------------------- equal to the oracles


def test_greedy_tokens_equal_python_runner(runner_exe, pte, prompts):
    expected = ecc.Runner(pte).generate(prompts, 16, n=2)
    answers, rc, stderr = run_all(
        runner_exe, pte, [request(f"p{i}", p, 16, n=2) for i, p in enumerate(prompts)])
    assert rc == 0, stderr
    assert errors_of(answers) == []
    for i, p in enumerate(prompts):
        got = tokens_of(answers, f"p{i}", n=2)
        assert got == expected[i], f"prompt {i}"
        fins = finishes_of(answers, f"p{i}")
        assert sorted(fins) == [0, 1]
        for j in (0, 1):
            usage = fins[j]["usage"]
            assert usage["prompt_tokens"] == len(p)
            assert usage["completion_tokens"] == len(got[j])
            eos_ended = len(got[j]) < 16
            assert fins[j]["finish"] == ("stop" if eos_ended else "length")
    # Every answer line names its request and sample; the ids echo as sent.
    assert {a["id"] for a in answers} == {f"p{i}" for i in range(len(prompts))}


def test_interleaved_requests_equal_each_alone(session, prompts):
    a, b = prompts[1], prompts[3]
    alone = []
    for p, k in ((a, 400), (b, 24)):
        s = session()
        s.send(request("x", p, k, stop_on_eos=False))
        s.wait_finished("x")
        rc, _ = s.close()
        assert rc == 0
        alone.append(tokens_of(s.seen, "x")[0])

    s = session()
    s.send(request("a", a, 400, stop_on_eos=False))
    s.until(lambda ans: ans.get("id") == "a" and "token" in ans)  # a decodes ...
    s.send(request("b", b, 24, stop_on_eos=False))                # ... when b arrives
    s.wait_finished("a")
    s.wait_finished("b")
    rc, stderr = s.close()
    assert rc == 0, stderr
    assert tokens_of(s.seen, "a")[0] == alone[0]
    assert tokens_of(s.seen, "b")[0] == alone[1]
    # They did run together: some of b's tokens came before a's last one.
    order = [ans["id"] for ans in s.seen if "token" in ans]
    assert order.index("b") < len(order) - 1 - order[::-1].index("a")
    assert (len(alone[0]), len(alone[1])) == (400, 24)


def test_conversation_turn_two_reuses_turn_one(runner_exe, pte, session, prompts):
    turn1 = prompts[1]
    s = session()
    s.send(request("t1", turn1, 10, stop_on_eos=False))
    s.wait_finished("t1")
    out1 = tokens_of(s.seen, "t1")[0]
    assert len(out1) == 10
    turn2 = turn1 + out1 + [340, 344, 454]  # the history, then the user's new tokens
    s.send(request("t2", turn2, 12, stop_on_eos=False))
    s.wait_finished("t2")
    rc, stderr = s.close()
    assert rc == 0, stderr
    usage = finishes_of(s.seen, "t2")[0]["usage"]
    # The last generated token was never fed back, so it is not cached.
    assert usage["cached_tokens"] == len(turn1) + len(out1) - 1
    assert usage["prompt_tokens"] == len(turn2)
    assert usage["completion_tokens"] == 12
    assert finishes_of(s.seen, "t1")[0]["usage"]["cached_tokens"] == 0
    # The cached turn gives the tokens a fresh prefill gives.
    expected = ecc.Runner(pte, prefix_cache=False).generate([turn2], 12, stop_on_eos=False)
    assert tokens_of(s.seen, "t2")[0] == expected[0][0]
    assert re.search(rf"prefix cache: {usage['cached_tokens']} of "
                     rf"{len(turn1) + len(turn2)} prompt tokens cached", stderr), stderr

    # --no-prefix-cache: the same turns, nothing cached, the same tokens.
    answers, rc, stderr = run_all(runner_exe, pte, [request("t1", turn1, 10, stop_on_eos=False)]
                                  + [request("t2", turn2, 12, stop_on_eos=False)],
                                  "--no-prefix-cache")
    assert rc == 0, stderr
    assert finishes_of(answers, "t2")[0]["usage"]["cached_tokens"] == 0
    assert tokens_of(answers, "t2")[0] == expected[0][0]
    assert "0 cells held at exit" in stderr


def test_eight_turn_conversation_prefills_only_new_tokens_and_equals_python(session, pte,
                                                                            prompts):
    """Each turn sends the whole history plus the user's new tokens; the engine
    reuses the previous turn's cells (cached = previous history + reply - 1,
    the reply's last token never being fed back) and its tokens equal the
    Python Runner carrying the same conversation."""
    python = ecc.Runner(pte)
    s = session()
    history = list(prompts[1])
    previous = None
    for turn in range(8):
        rid = f"turn{turn}"
        s.send(request(rid, history, 8, stop_on_eos=False))
        s.wait_finished(rid)
        got = tokens_of(s.seen[s.sent_at[json.dumps(rid)]:], rid)[0]
        assert got == python.generate([history], 8, stop_on_eos=False)[0][0], f"turn {turn}"
        usage = finishes_of(s.seen, rid)[0]["usage"]
        if previous is None:
            assert usage["cached_tokens"] == 0
        else:
            assert usage["cached_tokens"] == len(previous) + 8 - 1, f"turn {turn}"
            # Python's prefix cache made the same choice.
            assert python.last_stats.cached_tokens == [usage["cached_tokens"]]
        previous = list(history)
        history += got + [340 + turn, 344, 454]  # the reply, then the user's next message
    rc, stderr = s.close()
    assert rc == 0, stderr
    assert_no_cell_leaked(stderr)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 5, "top_p": 0.95}])
def test_eight_staggered_requests_each_equal_the_request_alone(session, sampling):
    """Eight requests, each sent once the one before it has its first token,
    decode together; each one's tokens are those it gets run alone (greedy, and
    seeded sampling: a sample's generator depends on (seed, sample) only)."""
    rng = __import__("random").Random(3)
    # r0 decodes 280 tokens, so the others (12 each) arrive while it runs, however
    # slowly this process sends them (a step of the default model takes ~0.2 ms);
    # all eight fit in the 512 cells at once (worst cases <= 291 + 4 x 34 + 3 x 23).
    reqs = [request(f"r{i}", [BOS] + [rng.randrange(2, VOCAB) for _ in range(rng.randrange(2, 12))],
                    280 if i == 0 else 12, n=1 + i % 2, stop_on_eos=False, **sampling)
            for i in range(8)]
    s = session("--no-prefix-cache")
    for r in reqs:  # alone: one at a time
        s.send(r)
        s.wait_finished(r["id"], r["n"])
    alone = {r["id"]: tokens_of(s.seen, r["id"], r["n"]) for r in reqs}
    rc, _ = s.close()
    assert rc == 0
    s = session("--no-prefix-cache")
    for r in reqs:
        s.send(r)
        s.until(lambda a, rid=r["id"]: a.get("id") == rid and "token" in a)
    for r in reqs:
        s.wait_finished(r["id"], r["n"])
    rc, stderr = s.close()
    assert rc == 0, stderr
    for r in reqs:
        assert tokens_of(s.seen, r["id"], r["n"]) == alone[r["id"]], r["id"]
    # They overlapped: every request had tokens before r0 finished.
    order = [(a["id"], "finish" in a) for a in s.seen if "token" in a or "finish" in a]
    r0_done = order.index(("r0", True))
    assert all(order.index((r["id"], False)) < r0_done for r in reqs), order[:r0_done + 1]
    assert "0 cells held at exit" in stderr


def test_cancel_mid_decode(session, prompts):
    s = session()
    s.send(request("long", prompts[0], 480, stop_on_eos=False, n=1))
    for _ in range(3):
        s.until(lambda a: a.get("id") == "long" and "token" in a)
    s.send({"cancel": "long"})
    fin = s.until(lambda a: a.get("id") == "long" and "finish" in a)
    assert fin["finish"] == "cancelled"
    got = tokens_of(s.seen, "long")[0]
    assert 3 <= len(got) < 480
    assert fin["usage"]["completion_tokens"] == len(got)
    assert fin["usage"]["prompt_tokens"] == len(prompts[0])
    # Its id is free again, the cancel of a finished request is an error, and the
    # server still serves.
    s.send({"cancel": "long"})
    err = s.until(lambda a: "error" in a)
    assert err["id"] == "long" and "no request with this id" in err["error"]
    later = len(s.seen)
    s.send(request("long", prompts[0], 5, stop_on_eos=False))
    s.wait_finished("long")
    rc, stderr = s.close()
    assert rc == 0, stderr
    assert len(tokens_of(s.seen[later:], "long")[0]) == 5
    assert finishes_of(s.seen[later:], "long")[0]["finish"] == "length"
    assert_no_cell_leaked(stderr)


def test_cancel_of_a_waiting_request_finishes_every_sample(session, prompts):
    # "big" needs all but a few cells in the worst case, so "wait" waits behind it.
    s = session()
    s.send(request("big", prompts[0], 480, stop_on_eos=False))
    s.until(lambda a: a.get("id") == "big" and "token" in a)
    s.send(request("wait", prompts[1], 40, n=3, stop_on_eos=False))
    s.send({"cancel": "wait"})
    s.wait_finished("wait", n=3)
    fins = finishes_of(s.seen, "wait")
    assert {f["finish"] for f in fins.values()} == {"cancelled"}
    assert all(f["usage"]["completion_tokens"] == 0 for f in fins.values())
    assert tokens_of(s.seen, "wait", n=3) == [[], [], []]
    s.send({"cancel": "big"})
    s.wait_finished("big")
    rc, stderr = s.close()
    assert rc == 0, stderr
    assert_no_cell_leaked(stderr)


# ---------------------------------------------------------------- logprobs, sampling


def test_logprobs_equal_log_softmax_of_python_logits(runner_exe, pte, prompts):
    prompt = prompts[1]
    answers, rc, stderr = run_all(runner_exe, pte,
                                  [request("lp", prompt, 8, logprobs=3, stop_on_eos=False)])
    assert rc == 0, stderr
    lines = [a for a in answers if "token" in a]
    assert len(lines) == 8
    tokens = [a["token"] for a in lines]
    # Oracle: teacher-forced raw logits of prompt + tokens[:-1] from the Python runner.
    r = ecc.Runner(pte, prefix_cache=False)
    seq = r.cache.seq_new()
    fed = prompt + tokens[:-1]
    logits = r.step([seq] * len(fed), fed, list(range(len(fed))),
                    list(range(len(prompt) - 1, len(fed))))
    for row, a in zip(logits.tolist(), lines):
        top = max(row)
        lse = top + math.log(sum(math.exp(v - top) for v in row))
        lp = [v - lse for v in row]
        assert a["logprob"] == pytest.approx(lp[a["token"]], abs=1e-3)
        assert len(a["top_logprobs"]) == 3
        reported = [v for _, v in a["top_logprobs"]]
        assert reported == sorted(reported, reverse=True)
        for tid, v in a["top_logprobs"]:
            assert v == pytest.approx(lp[tid], abs=1e-3)
        assert min(reported) >= sorted(lp, reverse=True)[2] - 1e-3
        assert a["token"] == a["top_logprobs"][0][0]  # greedy picks the most likely
    # No logprobs asked: none given.
    answers, rc, _ = run_all(runner_exe, pte, [request("plain", prompt, 3)])
    assert rc == 0
    assert all("logprob" not in a and "top_logprobs" not in a for a in answers)


def test_seeded_sampling_equals_batch_mode_and_repeats(runner_exe, pte, prompts, tmp_path):
    prompt = prompts[3]
    fields = dict(n=3, temperature=0.9, seed=11, top_k=50, stop_on_eos=False)
    answers, rc, stderr = run_all(runner_exe, pte,
                                  [request("s1", prompt, 12, **fields),
                                   request(2, prompt, 12, **fields)])
    assert rc == 0, stderr
    first, again = tokens_of(answers, "s1", 3), tokens_of(answers, 2, 3)
    assert first == again
    assert len({tuple(t) for t in first}) > 1, "samples of one request must differ"
    # The batch mode of the same binary: the same engine, the same (seed, sample) rule.
    (tmp_path / "p.txt").write_text(" ".join(map(str, prompt)) + "\n")
    out = subprocess.run([runner_exe, "--model", str(pte), "--prompts", str(tmp_path / "p.txt"),
                          "--n", "3", "--max-new-tokens", "12", "--temperature", "0.9",
                          "--seed", "11", "--no-stop-on-eos"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    batch = [[int(t) for t in line.split(":")[1].split()] for line in out.stdout.splitlines()]
    # top_k=50 in stdio only: compare with the same request without it.
    no_k = {k: v for k, v in fields.items() if k != "top_k"}
    answers, rc, _ = run_all(runner_exe, pte, [request("s3", prompt, 12, **no_k)])
    assert rc == 0
    assert tokens_of(answers, "s3", 3) == batch


# ---------------------------------------------------------------- bad input


BAD_LINES = [
    # (line sent, expected id of the error line, words the error must contain)
    ("not json at all\n", None, "not valid JSON"),
    ('{"id": "a", "prompt": [0, 1]\n', None, "not valid JSON"),
    ("[1, 2, 3]\n", None, "expected a JSON object"),
    ('"hello"\n', None, "expected a JSON object"),
    ("42\n", None, "expected a JSON object"),
    ('{"id": "f", "prompt": [0, 1.5]}\n', "f", "prompt[1] must be an integer token id"),
    ('{"id": "g", "prompt": [0, "1"]}\n', "g", "prompt[1] must be an integer token id"),
    ('{"id": "h", "prompt": "0 1"}\n', "h", "prompt must be a list of token ids"),
    ('{"id": "i", "prompt": []}\n', "i", "prompt is empty"),
    ('{"id": "j", "prompt": [0, 99999]}\n', "j", "outside the vocabulary"),
    ('{"id": "k", "prompt": [0, -1]}\n', "k", "outside the vocabulary"),
    ('{"id": "l", "prompt": [0], "n": "2"}\n', "l", "n must be an integer"),
    ('{"id": "m", "prompt": [0], "max_new_tokens": -3}\n', "m", "max_new_tokens must be"),
    ('{"id": "m2", "prompt": [0], "max_new_tokens": 2.0}\n', "m2", "max_new_tokens must be"),
    ('{"id": "n", "prompt": [0], "max_tokens": 5}\n', "n", 'unknown field "max_tokens"'),
    ('{"id": "o", "prompt": [0], "temprature": 0.5}\n', "o", 'unknown field "temprature"'),
    ('{"id": "p", "prompt": [0], "temperature": "hot"}\n', "p", "temperature must be a number"),
    ('{"id": "q", "prompt": [0], "temperature": -1}\n', "q", "temperature must be"),
    ('{"id": "r", "prompt": [0], "top_p": 1.5}\n', "r", "top_p must be"),
    ('{"id": "s", "prompt": [0], "top_k": 0}\n', "s", "top_k must be"),
    ('{"id": "t", "prompt": [0], "seed": -1}\n', "t", "seed must be an integer >= 0"),
    ('{"id": "u", "prompt": [0], "stop_on_eos": "yes"}\n', "u", "stop_on_eos must be true"),
    ('{"id": "v", "prompt": [0], "stop_token_ids": 5}\n', "v", "stop_token_ids must be a list"),
    ('{"id": "w", "prompt": [0], "logprobs": 50}\n', "w", "logprobs must be an integer in"),
    ('{"id": "w2", "prompt": [0], "speculative": "no"}\n', "w2",
     "speculative must be true or false"),
    ('{"id": "x", "prompt": [0], "max_new_tokens": 100000}\n', "x", "cells"),
    ('{"id": "y", "prompt": [0], "n": 0}\n', "y", "n must be"),
    ('{"id": "z", "prompt": [0], "n": 1, "n": 2}\n', "z", '"n" appears more than once'),
    ('{"cancel": "zz", "cancel": "z2"}\n', "z2", '"cancel" appears more than once'),
    ('{"id": "deep", "prompt": [1], "top_p": ' + "[" * 100000 + "]" * 100000 + "}\n", "deep",
     "nested deeper than 64 levels"),
    ('{"id": "deep2", "prompt": ' + "[" * 70 + "]" * 70 + "}\n", "deep2", "nested deeper"),
    ('{"id": "big", "prompt": [1], "temperature": 1e400}\n', None, "not valid JSON"),
    ('{"id": "stops", "prompt": [1], "stop_token_ids": [' + ",".join(["1"] * 1025) + "]}\n",
     "stops", "at most 1024"),
    ('{"prompt": [0]}\n', None, 'needs an "id"'),
    ('{"id": 1.5, "prompt": [0]}\n', None, '"id" must be a string or an integer'),
    ('{"id": true, "prompt": [0]}\n', None, '"id" must be a string or an integer'),
    ('{"id": "np"}\n', "np", 'needs "prompt"'),
    ('{"cancel": "nobody"}\n', "nobody", "no request with this id"),
    ('{"cancel": 12345}\n', 12345, "no request with this id"),
    ('{"cancel": [1]}\n', None, '"cancel" must be the id'),
    ('{"cancel": "a", "id": "a"}\n', "a", 'unknown field "id" in a cancel line'),
    ('{"id": "a", "prompt": [0]} {"id": "b"}\n', None, "not valid JSON"),
    (b'{"id": "bad\xff", "prompt": [0]}\n', None, "not valid JSON"),
]


def test_each_bad_line_gets_one_error_and_the_server_goes_on(runner_exe, pte, session, prompts):
    s = session("--no-prefix-cache")  # so that no cell may be held at the end
    good = request(7, prompts[2], 6)
    for i, (line, rid, words) in enumerate(BAD_LINES):
        s.send(line)
        err = s.next()  # nothing else runs: the next line is this one's answer
        assert set(err) == {"id", "error"}, err
        assert err["id"] == rid, (line, err)
        assert err["error"].startswith(f"line {i + 1}: "), err
        assert words in err["error"], (line, err)
    s.send(good)
    s.wait_finished(7)
    rc, stderr = s.close()
    assert rc == 0, stderr
    alone, rc, _ = run_all(runner_exe, pte, [good])
    assert tokens_of(s.seen, 7)[0] == tokens_of(alone, 7)[0]
    assert finishes_of(s.seen, 7)[0]["usage"]["completion_tokens"] == len(tokens_of(alone, 7)[0])
    assert f"(lines refused: {len(BAD_LINES)})" in stderr
    assert "0 cells held at exit" in stderr


def test_speculative_decoding_keeps_the_tokens_and_reports_its_counts(runner_exe, pte,
                                                                     prompts):
    """--speculative lookup and draft (the program as its own draft): every
    request's tokens equal plain serving's; usage counts each sample's
    proposed and accepted tokens, and they add up to the summary line's; a
    request with "speculative": false takes no proposals."""
    tok = HFTokenizer((CHECKPOINT / "tokenizer.json").read_text())
    copy = tok.encode("The cat sat on the mat. The cat sat on the mat. The cat sat")
    requests = [request(f"p{i}", p, 20, n=2) for i, p in enumerate(prompts + [copy])]
    requests.append(request("quiet", copy, 12, speculative=False))
    plain, rc, stderr = run_all(runner_exe, pte, requests)
    assert rc == 0, stderr
    assert "speculative" not in stderr
    assert all(set(f["usage"]) == {"prompt_tokens", "cached_tokens", "completion_tokens"}
               for f in plain if "finish" in f)
    for flags in (["--speculative", "lookup", "--lookup-min-ngram", "1"],
                  ["--speculative", "draft", "--draft-model", str(pte), "--draft-max", "4"]):
        answers, rc, stderr = run_all(runner_exe, pte, requests, *flags)
        assert rc == 0, stderr
        assert errors_of(answers) == []
        proposed = accepted = 0
        for r in requests:
            n = r.get("n", 1)
            assert tokens_of(answers, r["id"], n) == tokens_of(plain, r["id"], n), flags
            for f in finishes_of(answers, r["id"]).values():
                proposed += f["usage"]["proposed_tokens"]
                accepted += f["usage"]["accepted_tokens"]
                if r["id"] == "quiet":
                    assert f["usage"]["proposed_tokens"] == 0
        m = re.search(r"speculative \((\w+), up to (\d+) a step\): proposed (\d+) tokens, "
                      r"accepted (\d+)", stderr)
        assert m and m.group(1) == flags[1], stderr
        # --draft-max 4 as given; lookup's auto k within the program's step of 32
        assert int(m.group(2)) == 4 if flags[1] == "draft" else 1 <= int(m.group(2)) <= 31
        assert (int(m.group(3)), int(m.group(4))) == (proposed, accepted) and proposed > 0
        if flags[1] == "draft":
            assert accepted == proposed
        assert_no_cell_leaked(stderr)


def test_duplicate_live_id_is_refused_and_free_again_after_it_finishes(session, prompts):
    s = session()
    s.send(request("dup", prompts[0], 450, stop_on_eos=False))
    s.until(lambda a: a.get("id") == "dup" and "token" in a)
    s.send(request("dup", prompts[1], 4))
    err = s.until(lambda a: "error" in a)
    assert err["id"] == "dup" and "still running" in err["error"]
    # A string "7" and an integer 7 are two ids.
    s.send(request("7", prompts[1], 2))
    s.send(request(7, prompts[1], 2))
    s.wait_finished("7")
    s.wait_finished(7)
    s.send({"cancel": "dup"})
    s.wait_finished("dup")
    assert finishes_of(s.seen, "dup")[0]["finish"] == "cancelled"
    later = len(s.seen)
    s.send(request("dup", prompts[1], 4, stop_on_eos=False))
    s.wait_finished("dup")
    rc, stderr = s.close()
    assert rc == 0, stderr
    assert finishes_of(s.seen[later:], "dup")[0]["finish"] == "length"
    assert len(tokens_of(s.seen[later:], "dup")[0]) == 4
    assert len(errors_of(s.seen)) == 1
    assert_no_cell_leaked(stderr)


def test_an_oversized_line_is_refused_without_losing_the_next(session, prompts):
    s = session()
    huge = '{"id": "huge", "prompt": [' + "1, " * (2 << 20) + "1]}\n"  # ~6 MiB
    assert len(huge) > 4 << 20
    s.send(huge)
    err = s.next()
    assert err["id"] is None and err["error"] == \
        f"line 1: longer than the limit of {4 << 20} bytes; skipped"
    s.send(request("next", prompts[0], 3))
    s.wait_finished("next")
    rc, stderr = s.close()
    assert rc == 0, stderr
    # Just under the limit is fine (and too long for the cache: a cells error).
    under = '{"id": "u", "prompt": [' + ", ".join(["1"] * 1000) + "]}\n"
    s2 = session()
    s2.send(under)
    assert "cells" in s2.next()["error"]
    assert s2.close()[0] == 0


def test_blank_lines_are_skipped_but_counted(session, prompts):
    s = session()
    s.send("\n   \n\r\n")
    s.send("oops\n")
    err = s.next()
    assert err["error"].startswith("line 4: ")
    rc, _ = s.close()
    assert rc == 0


# ---------------------------------------------------------------- end of input


def test_end_of_input_mid_stream_finishes_every_request(runner_exe, pte, prompts):
    reqs = [request(f"e{i}", p, 40, n=2, stop_on_eos=False) for i, p in enumerate(prompts)]
    answers, rc, stderr = run_all(runner_exe, pte, reqs)
    assert rc == 0, stderr
    for i, p in enumerate(prompts):
        fins = finishes_of(answers, f"e{i}")
        assert sorted(fins) == [0, 1]
        toks = tokens_of(answers, f"e{i}", 2)
        for j in (0, 1):
            assert fins[j]["finish"] == "length"
            assert len(toks[j]) == 40 == fins[j]["usage"]["completion_tokens"]
            assert fins[j]["usage"]["prompt_tokens"] == len(p)
            # Nothing of a sample comes after its finish line.
            lines = [a for a in answers if a.get("id") == f"e{i}" and a["sample"] == j]
            assert "finish" in lines[-1] and all("token" in a for a in lines[:-1])
    assert "served 4 requests (lines refused: 0)" in stderr


def test_stdin_closed_while_decoding_and_mid_line(session, prompts):
    s = session()
    s.send(request("run", prompts[1], 64, stop_on_eos=False))
    s.until(lambda a: a.get("id") == "run" and "token" in a)
    s.send('{"id": "cut", "prompt": [0, 1')  # no newline: stdin closes inside this line
    rc, stderr = s.close()
    assert rc == 0, stderr
    fin = finishes_of(s.seen, "run")[0]
    assert fin["finish"] == "length"
    assert len(tokens_of(s.seen, "run")[0]) == 64
    (err,) = errors_of(s.seen)
    assert err["id"] is None and err["error"].startswith("line 2: not valid JSON")
    assert_no_cell_leaked(stderr)


def test_stdout_closed_early_exits_1(runner_exe, pte, prompts):
    proc = subprocess.Popen([runner_exe, "--model", str(pte), "--stdio"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write((json.dumps(request("a", prompts[0], 4)) + "\n").encode())
    proc.stdin.flush()
    proc.stdout.readline()
    proc.stdout.close()
    # Its answer cannot be written: the server stops serving, and exits 1 at the
    # end of its input.
    proc.stdin.write((json.dumps(request("b", prompts[1], 4)) + "\n").encode())
    proc.stdin.close()
    rc = proc.wait(timeout=TIMEOUT)
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    assert rc == 1, stderr
    assert "cellcache_runner: error: the output closed" in stderr.splitlines()[-1]


# ---------------------------------------------------------------- options and help


def test_help_documents_the_protocol(runner_exe):
    out = subprocess.run([runner_exe, "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for words in ("--stdio", '"cancel"', '"finish"', '"usage"', "4 MiB", "--no-prefix-cache",
                  "--prefix-cache-cells", "Exit status", "cached_tokens", "--speculative",
                  "--draft-model", "--draft-max", '"speculative": false', "proposed_tokens"):
        assert words in out.stdout, words


@pytest.mark.parametrize("flags, words", [
    (["--stdio", "--n", "2"], "--n is a batch-mode option"),
    (["--stdio", "--prompts", "x.txt"], "--prompts is a batch-mode option"),
    (["--stdio", "--no-prefix-cache", "--prefix-cache-cells", "64"], "one or the other"),
    (["--stdio", "--prefix-cache-cells", "-1"], "--prefix-cache-cells expects an integer >= 0"),
    (["--stdio", "--prefix-cache-cells", "1025"], "prefix_cache_cells"),
    (["--print-info", "--no-prefix-cache"], "--print-info takes only --model"),
    (["--stdio", "--speculative", "draft"], "needs a draft model (--draft-model D.pte)"),
    (["--stdio", "--lookup-max-ngram", "2"], "--lookup-max-ngram sets up speculative decoding"),
    ([], "--prompts FILE (batch mode) or --stdio"),
])
def test_bad_options_exit_2_with_one_error_line(runner_exe, pte, flags, words):
    out = subprocess.run([runner_exe, "--model", str(pte), *flags], capture_output=True,
                         text=True, input="", timeout=300)
    assert out.returncode == 2
    (line,) = out.stderr.splitlines()
    assert line.startswith("cellcache_runner: error: ") and words in line, line
    assert out.stdout == ""


def test_missing_model_exits_2(runner_exe, tmp_path):
    out = subprocess.run([runner_exe, "--model", str(tmp_path / "no.pte"), "--stdio"],
                         capture_output=True, text=True, input="", timeout=60)
    assert out.returncode == 2
    assert out.stderr.startswith("cellcache_runner: error: ")


def test_prefix_cache_cells_bounds_what_stays_cached(session, prompts):
    turn1 = prompts[3]
    turn2 = turn1 + [340]
    cached = []
    for flags in ([], ["--prefix-cache-cells", "4"]):
        s = session(*flags)
        s.send(request("t1", turn1, 10, stop_on_eos=False))
        s.wait_finished("t1")
        s.send(request("t2", turn2, 4, stop_on_eos=False))
        s.wait_finished("t2")
        rc, stderr = s.close()
        assert rc == 0, stderr
        cached.append(finishes_of(s.seen, "t2")[0]["usage"]["cached_tokens"])
    # Unbounded: all of turn 1 (its prompt is a prefix of what t1 holds); bounded
    # to 4 cells: the entry is cut to its first 4 positions.
    assert cached == [len(turn1), 4]


def test_batch_mode_takes_the_prefix_cache_options(runner_exe, pte, prompts, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("".join(" ".join(map(str, p)) + "\n" for p in prompts))
    outs = []
    for flags in ([], ["--no-prefix-cache"], ["--prefix-cache-cells", "16"]):
        out = subprocess.run([runner_exe, "--model", str(pte), "--prompts", str(f),
                              "--max-new-tokens", "8", *flags],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        outs.append(out.stdout)
    assert outs[0] == outs[1] == outs[2]
