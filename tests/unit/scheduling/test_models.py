"""Several models (gateway/scheduling/models.py): grouping servers by model, resolving a request's model,
per-model policies and state, the open (one model) mode. No sockets."""

from __future__ import annotations

import pytest

from gateway.config.models import build_policies, configured_names
from gateway.config.settings import ConfigError, load_config
from gateway.errors import BadRequest, ModelNotFound
from gateway.request import parse_request
from gateway.scheduling.models import Models
from gateway.scheduling.scheduler import Scheduler
from gateway.servers.pool import Server, ServerPool

SERVERS = ["--prefill", "http://p:1", "--decode", "http://d:1"]


def config(*argv: str):
    return load_config([*SERVERS, *argv], environ={})


def server(url: str, role: str, model: str | None, verified: bool = True) -> Server:
    server = Server(url, role, 8998 if role == "prefill" else None, model=model)
    server.verified = verified
    return server


def two_models(*argv: str, extra: tuple[Server, ...] = ()) -> tuple[Models, Scheduler]:
    """alpha: 2 prefill + 1 decode; beta: 1 + 1."""
    cfg = config(*argv)
    pool = ServerPool()
    for w in (server("http://a-p1:1", "prefill", "alpha"), server("http://a-p2:1", "prefill",
              "alpha"), server("http://a-d1:1", "decode", "alpha"),
              server("http://b-p1:1", "prefill", "beta"), server("http://b-d1:1", "decode",
              "beta"), *extra):
        pool.add(w)
    models = Models(pool, lambda name: build_policies(cfg, name), aliases=cfg.model_aliases,
                    default=cfg.default_model, configured=configured_names(cfg),
                    fallback=cfg.model)
    return models, Scheduler(pool, models)


def chat(model: str | None, text: str = "hello") -> object:
    body = b'{"messages": [{"role": "user", "content": "' + text.encode() + b'"}]'
    if model is not None:
        body += b', "model": "' + model.encode() + b'"'
    return parse_request("chat", body + b"}")


ALIASES = '{"fast": "beta", "big": "alpha", "s3://b:x": "beta"}'


@pytest.mark.parametrize("asked, model, upstream", [
    ("alpha", "alpha", "alpha"),
    ("beta", "beta", "beta"),
    ("fast", "beta", "beta"),  # an alias: the body upstream names the model
    ("alpha:my-lora", "alpha", "alpha:my-lora"),  # SGLang's LoRA syntax
    ("big:my-lora", "alpha", "alpha:my-lora"),  # an alias with an adapter: rewritten
    ("s3://b:x", "beta", "beta"),  # an alias holding ':' matches whole first
    ("s3://b:x:lora", "beta", "beta:lora"),
    (None, "beta", None),  # no model: --default-model (an alias of beta)
    ("default", "beta", "default"),  # SGLang's own default name means the same
], ids=["name", "other-name", "alias", "lora", "alias-lora", "alias-with-colon",
        "alias-with-colon-lora", "none-default", "default-word"])
def test_resolution(asked, model, upstream):
    models, _ = two_models("--model-aliases", ALIASES, "--default-model", "fast")
    view = models.resolve(chat(asked))
    assert view.model == model
    assert view.body.get("model") == upstream
    assert models.of(view).name == model


@pytest.mark.parametrize("asked", ["gamma", "alphabet", "gamma:alpha", ""],
                         ids=["unknown", "prefix-of-no-model", "adapter-of-unknown", "empty"])
def test_unknown_model_is_404_in_openai_shape(asked):
    models, _ = two_models()
    with pytest.raises(ModelNotFound) as info:
        models.resolve(chat(asked))
    body = info.value.body()["error"]
    assert info.value.status == 404
    assert body["code"] == "model_not_found" and body["type"] == "invalid_request_error"
    assert body["param"] == "model" and "alpha, beta" in body["message"]


@pytest.mark.parametrize("asked", [None, "default"], ids=["absent", "default-word"])
def test_no_model_with_several_and_no_default_is_400_naming_them(asked):
    models, _ = two_models()
    with pytest.raises(BadRequest, match="alpha, beta") as info:
        models.resolve(chat(asked))
    assert info.value.status == 400 and info.value.code == "model_required"


def test_one_model_without_settings_is_open_and_allocates_nothing():
    pool = ServerPool()
    pool.add(server("http://p:1", "prefill", "only"))
    pool.add(server("http://d:1", "decode", "only"))
    cfg = config()
    models = Models(pool, lambda name: build_policies(cfg, name))
    assert models.open and models.only.name == "only"
    for asked in (None, "default", "only", "anything-else"):
        view = chat(asked)
        assert models.resolve(view) is view  # the same object: no copy, no check
        assert models.of(view) is models.only


def test_one_model_with_aliases_rewrites_them_and_stays_lenient():
    pool = ServerPool()
    pool.add(server("http://p:1", "prefill", "only"))
    pool.add(server("http://d:1", "decode", "only"))
    cfg = config("--model-aliases", '{"o": "only"}')
    models = Models(pool, lambda name: build_policies(cfg, name), aliases=cfg.model_aliases,
                    configured=configured_names(cfg))
    assert models.open
    assert models.resolve(chat("o")).body["model"] == "only"  # an alias is rewritten
    for asked in (None, "other"):  # one model: any name is its, sent as is (as SGLang does)
        view = models.resolve(chat(asked))
        assert view.body.get("model") == asked and models.of(view).name == "only"


@pytest.mark.parametrize("asked, expected", [
    ("alpha", "alpha"),
    ("fast", "beta"),
    ("alpha:my-lora", "alpha"),
    ("gamma", "other"),
    (None, "other"),
], ids=["model", "alias-counts-under-its-model", "adapter", "unknown", "none-of-several"])
def test_usage_labels_are_resolved_model_names(asked, expected):
    models, _ = two_models("--model-aliases", ALIASES)
    assert models.label(asked) == expected


def test_usage_label_of_a_single_model_gateway_is_its_model_whatever_is_asked():
    pool = ServerPool()
    pool.add(server("http://p:1", "prefill", "only"))
    cfg = config()
    models = Models(pool, lambda name: build_policies(cfg, name))
    assert {models.label(asked) for asked in (None, "only", "gpt-4")} == {"only"}
    assert Models(ServerPool(), lambda name: build_policies(cfg, name)).label(None) == "other"


def dispatched(scheduler, prefill, decode, view) -> None:
    """What the proxy tells the policies when it sends a pair (ledger.Ledger.opened)."""
    policies = scheduler.policies_of(prefill.server)
    policies["prefill"].on_dispatch(prefill, view)
    policies["decode"].on_dispatch(decode, view)


def test_each_model_has_its_own_policy_instances_and_servers():
    models, scheduler = two_models()
    alpha, beta = models.known["alpha"], models.known["beta"]
    assert alpha.policies["prefill"] is not beta.policies["prefill"]
    for _ in range(6):
        prefill, decode = scheduler.pick(models.resolve(chat("beta", "same prompt")))
        assert (prefill.url, decode.url) == ("http://b-p1:1", "http://b-d1:1")
        dispatched(scheduler, prefill, decode, models.resolve(chat("beta", "same prompt")))
    prefill, decode = scheduler.pick(models.resolve(chat("alpha", "same prompt")))
    assert prefill.url.startswith("http://a-") and decode.url == "http://a-d1:1"
    dispatched(scheduler, prefill, decode, models.resolve(chat("alpha", "same prompt")))
    # each cache_aware tree holds only its own model's servers
    assert set(beta.policies["prefill"].stats()["tree_size_by_worker"]) == {"http://b-p1:1"}
    assert set(alpha.policies["prefill"].stats()["tree_size_by_worker"]) <= {
        "http://a-p1:1", "http://a-p2:1"}
    # the hooks go back to the policy that chose (the server's model's)
    assert scheduler.policies_of(prefill.server) is alpha.policies
    assert scheduler.policies_of(decode) is alpha.policies


def test_per_model_policy_settings_default_to_the_global_ones():
    settings = ('{"beta": {"prefill_policy": "round_robin", "policy_options": '
                '{"least_load": {"usage_weight": 0.5}}}}')
    models, _ = two_models("--policy-options", '{"cache_aware": {"match_threshold": 0.7}}',
                           "--model-policies", settings)
    alpha, beta = models.known["alpha"].policies, models.known["beta"].policies
    # the default (auto) takes what was written for cache_aware (prefill) and least_load
    assert (alpha["prefill"].name, alpha["decode"].name) == ("auto", "auto")
    assert alpha["prefill"].options.match_threshold == 0.7  # the global options
    assert (beta["prefill"].name, beta["decode"].name) == ("round_robin", "auto")
    assert beta["decode"].options.usage_weight == 0.5


def test_a_server_whose_model_is_not_known_yet_serves_no_model():
    unprobed = server("http://g-p1:1", "prefill", None, verified=False)
    models, scheduler = two_models(extra=(unprobed,))
    assert models.unnamed == 1 and set(models.known) == {"alpha", "beta"}
    with pytest.raises(ModelNotFound, match="1 servers have not reported their model yet"):
        models.resolve(chat("gamma"))
    unprobed.model, unprobed.verified = "gamma", True  # what its first good probe does
    scheduler.pool.add(server("http://g-d1:1", "decode", "gamma"))  # notify: regroup
    assert models.unnamed == 0
    prefill, decode = scheduler.pick(models.resolve(chat("gamma")))
    assert (prefill.url, decode.url) == ("http://g-p1:1", "http://g-d1:1")


def test_a_verified_server_reporting_no_model_takes_the_fallback_name():
    models, _ = two_models("--model", "alpha",
                           extra=(server("http://x-p:1", "prefill", None),))
    assert [w.url for w in models.known["alpha"].servers["prefill"]] == [
        "http://a-p1:1", "http://a-p2:1", "http://x-p:1"]


def test_a_configured_model_without_servers_is_503_not_404():
    models, scheduler = two_models("--model-policies", '{"gamma": {}}')
    view = models.resolve(chat("gamma"))
    with pytest.raises(Exception, match="no usable prefill and decode server of model 'gamma'"):
        scheduler.pick(view)


def test_readiness_needs_one_model_with_both_roles():
    models, scheduler = two_models()
    assert models.ready()
    for server in models.known["alpha"].servers["decode"] + models.known["beta"].servers[
            "prefill"]:
        server.healthy = False  # alpha has no decode, beta no prefill: no pair anywhere
    assert not models.ready()


@pytest.mark.parametrize("argv, message", [
    (["--model-aliases", '{"a": "b", "b": "c"}'], "names the alias"),
    (["--model-aliases", '{"default": "x"}'], "already means the default"),
    (["--model-aliases", '{"a": 3}'], "must name a model"),
    (["--default-model", "default"], "name a model"),
    (["--model-policies", '{"m": {"prefil_policy": "random"}}'], "unknown key 'prefil_policy'"),
    (["--model-policies", '{"m": {"policy": "nope"}}'], "'nope' is unknown"),
    (["--model-policies", '{"m": {"policy_options": {"cache_aware": {"bogus": 1}}}}'],
     "unknown option 'bogus'"),
    (["--model-aliases", '{"a": "m"}', "--model-policies", '{"a": {}}'], "is an alias"),
], ids=["alias-chain", "alias-default", "alias-not-a-name", "default-default",
        "unknown-key", "unknown-policy", "bad-option", "policies-of-alias"])
def test_model_settings_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        config(*argv)


def test_file_form_names_a_servers_model(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text("prefill: [{url: 'http://p:1', model: alpha}]\n"
                    "decode: ['http://d:1']\nmodel_aliases: {a: alpha}\n")
    cfg = load_config(["--config", str(path)], environ={})
    assert cfg.prefill[0].model == "alpha" and cfg.decode[0].model is None
    assert cfg.model_aliases == {"a": "alpha"}


def test_a_models_own_name_wins_over_an_alias_of_that_name():
    models, _ = two_models("--model-aliases", '{"beta": "alpha"}')
    assert models.resolve(chat("beta")).model == "beta"


def test_a_model_with_servers_of_one_role_is_warned_about_once(caplog):
    """One model whose roles report different names becomes two models that cannot serve:
    the log says so, naming both, once."""
    pool = ServerPool()
    pool.add(server("http://p:1", "prefill", "org/llama"))
    pool.add(server("http://d:1", "decode", "llama"))
    cfg = config()
    with caplog.at_level("WARNING", logger="gateway.scheduling.models"):
        models = Models(pool, lambda name: build_policies(cfg, name))
        models.regroup()
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2
    assert "model llama has decode servers but no prefill server" in warned[0]
    assert "same --served-model-name" in warned[1] and "llama, org/llama" in warned[1]
