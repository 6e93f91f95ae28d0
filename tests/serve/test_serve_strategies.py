"""Every strategy behind the server: greedy output, exit layers and statistics equal
generation alone; per-request strategy options; eight concurrent clients each get exactly
their single-request output; the API key."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _serve_util import API_KEY, Reference, Server

pytest.importorskip("openai")

STRATEGIES = ["ar", "early-exit", "self-spec", "ppd"]
OPTIONS = {"self-spec": {"exit_layer": 2}, "ppd": {"ppd_layer": 2, "ppd_k": 2}}


def _client(server: Server, strategy: str):  # type: ignore[no-untyped-def]
    return server.client(api_key=API_KEY) if strategy == "ppd" else server.client()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_greedy_equals_generate(servers: dict[str, Server], reference: Reference,
                                strategy: str) -> None:
    server = servers[strategy]
    client = _client(server, strategy)
    for prompt in ("Hello", "import os\nimport sys\n"):
        alone = reference.run(prompt, strategy, max_new_tokens=20, **OPTIONS.get(strategy, {}))
        res = client.completions.create(model="tiny", prompt=prompt, max_tokens=20,
                                        temperature=0, extra_body={"return_exit_layers": True})
        body = res.model_dump()
        assert body["choices"][0]["text"] == alone.text
        summary = body["early_exit"]
        assert summary["strategy"] == strategy
        if strategy == "self-spec":  # the draft length is chosen per step (from timings)
            assert set(body["choices"][0]["exit_layers"]) <= {2, 4}
            assert set(summary["stats"]) == set(alone.stats.to_dict())
            st = summary["stats"]
            assert st["rounds"] + st["plain_steps"] + st["probe_steps"] > 0
        else:
            assert body["choices"][0]["exit_layers"] == alone.exit_layers
            assert summary["layer_evaluations"] == alone.layer_evaluations
            assert summary["stats"] == pytest.approx(alone.stats.to_dict())
        streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=20,
                                             temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == alone.text
    if strategy == "self-spec":  # draft acceptance and step choices reach /metrics
        st = summary["stats"]
        event = "drafted" if st["drafted"] else "plain_steps"
        server.wait_for(lambda: server.metric(
            f'exitlm_strategy_events_total{{event="{event}"}}') >= st[event])
        rate = server.metric('exitlm_strategy_rate{rate="acceptance_rate"}')
        assert 0 <= rate <= 1
        share = server.metric('exitlm_strategy_rate{rate="plain_share"}')
        assert 0 <= share <= 1


def test_per_request_options(servers: dict[str, Server], reference: Reference) -> None:
    ee = servers["early-exit"].client()
    for threshold in (1.0, 0.5):
        res = ee.completions.create(model="tiny", prompt="Hello", max_tokens=16, temperature=0,
                                    extra_body={"threshold": threshold,
                                                "return_exit_layers": True})
        alone = reference.run("Hello", "early-exit", max_new_tokens=16, threshold=threshold)
        assert res.choices[0].text == alone.text
        assert res.model_dump()["choices"][0]["exit_layers"] == alone.exit_layers
    assert alone.exits().early_exit_fraction > 0  # 0.5 exits early, 1.0 never does
    server = servers["early-exit"]
    early = sum(server.metric(f'exitlm_generation_tokens_by_exit_layer_total{{layer="{x}"}}')
                for x in (1, 2, 3))
    assert early >= sum(1 for x in alone.exit_layers if x < 4)

    ss = servers["self-spec"].client()
    res = ss.completions.create(model="tiny", prompt="Hello", max_tokens=16, temperature=0,
                                extra_body={"num_speculations": 2})
    alone = reference.run("Hello", "self-spec", max_new_tokens=16, exit_layer=2,
                          num_speculations=2)
    assert res.model_dump()["early_exit"]["stats"] == pytest.approx(alone.stats.to_dict())
    # the draft exit shapes the decoder: fixed when the server starts
    status, body = servers["self-spec"].call(
        "POST", "/v1/completions", {"prompt": "x", "exit_layer": 3})
    assert status == 400 and body["error"]["param"] == "exit_layer"
    assert "fixed when the server starts" in body["error"]["message"]


@pytest.mark.parametrize(("strategy", "name", "value"), [
    ("early-exit", "threshold", "0.5"), ("early-exit", "threshold", True),
    ("early-exit", "threshold", 1.5), ("early-exit", "max_pending", "1"),
    ("early-exit", "max_pending", None), ("self-spec", "draft_threshold", " 0.5 "),
    ("self-spec", "num_speculations", 2.0)])
def test_per_request_options_are_typed_strictly(servers: dict[str, Server], strategy: str,
                                                name: str, value: object) -> None:
    """JSON numbers only ("0.5" is a string, though a YAML config may spell a number so), in
    range, null only where the option takes it: a 400 naming the option."""
    status, body = servers[strategy].call("POST", "/v1/completions",
                                          {"prompt": "x", "max_tokens": 2, name: value})
    assert status == 400, body
    assert body["error"]["param"] == name and name in body["error"]["message"]


@pytest.mark.parametrize(("strategy", "extra"), [
    ("ar", {}), ("self-spec", {}), ("early-exit", {"threshold": 1.0})])
def test_eight_concurrent_clients_get_their_own_output(
        servers: dict[str, Server], reference: Reference, strategy: str, extra: dict) -> None:
    server = servers[strategy]
    jobs = [(f"{'ab' * i}prompt {i}:", 6 + 3 * i) for i in range(8)]
    opts = {**OPTIONS.get(strategy, {}), **extra}
    want = [reference.run(p, strategy, max_new_tokens=n, **opts).text for p, n in jobs]

    def one(job: tuple[str, int]) -> str:
        prompt, n = job
        res = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=n,
                                                 temperature=0, extra_body=extra)
        return res.choices[0].text

    for _ in range(2):
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, jobs)) == want
    assert server.health()["running"] == 0


def test_api_key(servers: dict[str, Server]) -> None:
    import openai

    ppd = servers["ppd"]
    for key in ("wrong", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for path in ("/v1/models", "/tokenize"):
            status, body = ppd.call("GET" if "models" in path else "POST", path,
                                    {"prompt": "x"}, headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        ppd.client(api_key="wrong").completions.create(model="tiny", prompt="x", max_tokens=1)
    assert ppd.call("GET", "/health")[0] == 200  # open, as are the metrics
    assert ppd.call("GET", "/metrics")[0] == 200
    res = ppd.client(api_key=API_KEY).completions.create(model="tiny", prompt="x",
                                                         max_tokens=2, temperature=0)
    assert res.usage.completion_tokens == 2


def test_pipeline_inference_behind_the_server(checkpoint: Path, reference: Reference) -> None:
    """``--kv pipeline``: the decoder starts its stage processes with the engine; greedy output
    and exit layers equal KV recomputation's (EE-LLM Sec. 4: same exits, KV filled by the
    later stages instead of recomputed)."""
    server = Server([str(checkpoint), "--served-model-name", "tiny", "--strategy", "early-exit",
                     "--threshold", "0.5", "--kv", "pipeline"]).wait_ready()
    try:
        for prompt in ("Hello", "import os\n"):
            alone = reference.run(prompt, "early-exit", max_new_tokens=16, threshold=0.5)
            res = server.client().completions.create(
                model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                extra_body={"return_exit_layers": True})
            assert res.choices[0].text == alone.text
            assert res.model_dump()["choices"][0]["exit_layers"] == alone.exit_layers
        assert alone.exits().early_exit_fraction > 0
    finally:
        assert server.stop() == 0
