"""`python -m attn_kernels.mlx_lm server`: mlx_lm.server with the fused kernels on, started on a
loopback port and driven by an HTTP client with concurrent OpenAI-style requests (completions and
chat, streamed and not), every answer compared with mlx_lm.server's own on the same model; a
malformed request gets mlx-lm's error while the others finish. Client loops are bounded in count
and time; the servers are stopped (SIGINT, then killed) whatever happens."""

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

from mlx.utils import tree_flatten
from test_mlx_lm import ARCHS, LAYERS, VOCAB, tiny_model

# The kernel's server process: the guard widened as the in-process tests widen it (the tiny model
# is float32; the records cover bf16), then the command itself.
KERNEL_SERVER = """
import dataclasses, faulthandler, signal, sys
faulthandler.register(signal.SIGUSR1)  # every thread's stack on stderr, for a server that hangs
from attn_kernels import guard
from attn_kernels.attention import FLOAT_DTYPES, MAX_HEAD_DIM
guard.LIMITS["cpu"] = dataclasses.replace(
    guard.LIMITS["cpu"], head_dims=tuple(range(1, MAX_HEAD_DIM + 1)), dtypes=FLOAT_DTYPES,
    max_batch=64)
from attn_kernels.mlx_lm.__main__ import main
sys.exit(main(sys.argv[1:]))
"""
STARTUP_SECONDS, REQUEST_SECONDS = 120, 60
STOP_SECONDS = 20


def model_folder(path):
    """mlx-lm's layout of the tiny qwen3 (D=128, float32) with a word-level tokenizer that has
    an end token and a chat template."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True)
    model = tiny_model("qwen3", mx.float32)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = dict(model_type="qwen3", num_hidden_layers=LAYERS, intermediate_size=256)
    config.update(rms_norm_eps=1e-5, vocab_size=VOCAB, **ARCHS["qwen3"])
    (path / "config.json").write_text(json.dumps(config))
    words = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = Whitespace()
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="w1")
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(path))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(command, folder, log):
    """A server process on a free loopback port, ready (GET /v1/models answers) within
    STARTUP_SECONDS; yields (base URL, process); SIGINT (then kill) on the way out."""
    port = free_port()
    args = [*command, "--model", str(folder), "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as out:
        # SIGINT as a terminal gives it: a job started with `&` by a non-interactive shell (a CI
        # script run in the background) inherits SIGINT ignored, and Python then never raises
        # KeyboardInterrupt, so the server would not stop.
        process = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if process.poll() is not None:
                pytest.fail(f"server exited {process.returncode}: {log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2).read()
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    pytest.fail(f"server not up in {STARTUP_SECONDS} s: {log.read_text()[-2000:]}")
                time.sleep(0.5)
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def stop(process, log, seconds=STOP_SECONDS):
    """Wait for a server sent SIGINT to exit; if it does not, its threads' stacks (SIGUSR1,
    faulthandler) and the end of its log in the failure."""
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGUSR1)
        time.sleep(1)
        process.kill()
        process.wait()
        pytest.fail(f"server still running {seconds} s after SIGINT: {log.read_text()[-6000:]}")


def post(url, path, body: bytes):
    """(status, parsed JSON or the concatenated text of a stream)."""
    request = urllib.request.Request(
        url + path, data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as response:
            raw = response.read().decode()
            status = response.status
            stream = response.headers.get_content_type() == "text/event-stream"
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())
    if not stream:
        return status, json.loads(raw)
    text = ""
    for line in raw.splitlines():
        if line.startswith("data:") and line.strip() != "data: [DONE]":
            choice = json.loads(line[5:])["choices"][0]
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return status, text


def answer(status, payload):
    """The generated text of a non-streamed answer (or a stream's text)."""
    assert status == 200, payload
    if isinstance(payload, str):
        return payload
    choice = payload["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


REQUESTS = [
    ("/v1/completions", dict(prompt=f"w{3 + i} w{40 + 7 * i} w{90 + 13 * i}"), stream)
    for i, stream in enumerate([False, True, False, True, False])
] + [
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": f"w{5 + i} w{60 + i}"}]), s)
    for i, s in enumerate([False, True, False])
]


def run_requests(url):
    """Every request of REQUESTS concurrently, with one malformed body among them."""
    bodies = [
        (path, json.dumps(body | dict(max_tokens=8, temperature=0.0, stream=stream)).encode())
        for path, body, stream in REQUESTS
    ]
    bodies.insert(3, ("/v1/completions", b"{not json"))
    with ThreadPoolExecutor(len(bodies)) as pool:
        results = list(pool.map(lambda b: post(url, *b), bodies))
    malformed = results.pop(3)
    return [answer(*r) for r in results], malformed


def test_server_answers_as_mlx_lms_own(tmp_path):
    folder = model_folder(tmp_path / "model")
    ours_log, theirs_log = tmp_path / "ours.log", tmp_path / "theirs.log"
    with (
        server([sys.executable, "-c", KERNEL_SERVER, "server"], folder, ours_log) as (ours, proc),
        server([sys.executable, "-m", "mlx_lm.server"], folder, theirs_log) as (theirs, _),
    ):
        our_texts, our_error = run_requests(ours)
        their_texts, their_error = run_requests(theirs)
        # the servers still answer after the malformed request
        assert answer(*post(ours, *REQUESTS_AFTER)) == answer(*post(theirs, *REQUESTS_AFTER))
        proc.send_signal(signal.SIGINT)
        stop(proc, ours_log)
    assert our_texts == their_texts
    assert all(len(t.split()) >= 1 for t in our_texts)
    assert our_error[0] == their_error[0] == 400
    assert our_error[1] == their_error[1]
    # every decode step fused (8 concurrent requests batched), the prefills through mlx-lm's
    counts = ours_log.read_text().rsplit("[attn_kernels] attention calls: ", 1)[1]
    fused_steps = int(counts.split(" fused steps")[0])
    assert fused_steps >= LAYERS * 7


REQUESTS_AFTER = (
    "/v1/completions",
    json.dumps(dict(prompt="w7 w8 w9", max_tokens=5, temperature=0.0)).encode(),
)
