"""`fxrewrite serve`'s server-wide flags (vLLM's), each through a real app: GET /v1/models/{id} on the shared
server, and a second server started with --disable-uvicorn-access-log, --disable-fastapi-docs, --root-path,
--enable-request-id-headers, --response-role, --return-tokens-as-token-ids, --enable-force-include-usage and
--enable-prompt-tokens-details."""

import json

import httpx
import pytest
from tests.server.conftest import API_KEY, MODEL_NAME, cli_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
FLAGS = ["--disable-uvicorn-access-log", "--disable-fastapi-docs", "--root-path", "/api", "--enable-request-id-headers",
         "--response-role", "bot", "--return-tokens-as-token-ids", "--enable-force-include-usage",
         "--enable-prompt-tokens-details"]


@pytest.fixture(scope="module")
def flagged(tiny_model_dir):
    """(base URL, uvicorn.Server) of a server started with every flag of `FLAGS`, as `fxrewrite serve` starts it."""
    with cli_server(tiny_model_dir("qwen3"), *FLAGS, log_level="info") as (url, _, _app, uv):
        yield url, uv


def test_retrieve_model_is_the_list_entry_and_unknown_is_a_404(server):
    with server.http() as http:
        listed = http.get("/v1/models").json()["data"][0]
        got = http.get(f"/v1/models/{MODEL_NAME}")
        missing = http.get("/v1/models/no-such-model")
    assert got.status_code == 200
    assert {k: v for k, v in got.json().items() if k != "created"} == {k: v for k, v in listed.items() if k != "created"}
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert "no-such-model" in error["message"] and error["code"] == "model_not_found"
    assert server.client().models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert httpx.get(f"{server.base_url}/v1/models/{MODEL_NAME}").status_code == 401  # the key guards it


def test_defaults_keep_docs_and_send_no_request_id(server):
    response = httpx.get(f"{server.base_url}/openapi.json")
    assert response.status_code == 200 and "x-request-id" not in response.headers
    assert httpx.get(f"{server.base_url}/docs").status_code == 200


def test_disable_fastapi_docs(flagged):
    url, _ = flagged
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(url + path).status_code == 404, path


def test_root_path_serves_under_the_prefix_and_keeps_the_key(flagged):
    url, _ = flagged
    # a proxy in front strips /api; uvicorn puts it back in the path (root_path + path), the routes match without it
    assert httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"][0]["id"] == MODEL_NAME
    assert httpx.get(f"{url}/v1/models").status_code == 401  # the prefix does not dodge the key check


def test_request_id_headers(flagged):
    url, _ = flagged
    echoed = httpx.get(f"{url}/health", headers={"X-Request-Id": "abc-123"})
    fresh = [httpx.get(f"{url}/health").headers["x-request-id"] for _ in range(2)]
    assert echoed.headers["x-request-id"] == "abc-123"
    assert fresh[0] != fresh[1] and all(len(f) == 32 for f in fresh)


def test_access_log_is_off(flagged):
    _, uv = flagged
    assert uv.config.access_log is False  # uvicorn then writes no access line (its h11 / httptools protocols)


def _chat(url: str, **body) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "temperature": 0, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)


def test_response_role_and_token_ids_default(flagged):
    url, _ = flagged
    choice = _chat(url, logprobs=True).json()["choices"][0]
    assert choice["message"]["role"] == "bot"
    assert all(t["token"].startswith("token_id:") for t in choice["logprobs"]["content"])
    own = _chat(url, logprobs=True, return_tokens_as_token_ids=False).json()["choices"][0]  # the request's own
    assert not any(t["token"].startswith("token_id:") for t in own["logprobs"]["content"])
    continued = _chat(url, add_generation_prompt=False).json()["choices"][0]
    assert continued["message"]["role"] == "user"  # without a generation prompt: the last message's role


def test_force_include_usage(flagged):
    url, _ = flagged
    lines = [line[6:] for line in _chat(url, stream=True).text.splitlines() if line.startswith("data: {")]
    chunks = [json.loads(line) for line in lines]
    assert chunks[0]["choices"][0]["delta"]["role"] == "bot"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    completion = httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2,
                                                           "stream": True}, headers=AUTH, timeout=60)
    last = json.loads([line for line in completion.text.splitlines() if line.startswith("data: {")][-1][6:])
    assert last["usage"]["completion_tokens"] == 2


def test_prompt_tokens_details_count_the_cached_prompt_tokens(flagged, server):
    """fresh-user report: vLLM's --enable-prompt-tokens-details was an unrecognized argument. With it, usage
    carries prompt_tokens_details.cached_tokens once the prefix cache served part of the prompt (vLLM's rule:
    left out when none was); without it, never."""
    url, _ = flagged
    prompt = "one two three four five six seven eight nine ten " * 8  # several 16-token blocks
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}
    post = lambda base, path, **kw: httpx.post(f"{base}{path}", json={**body, **kw}, headers=AUTH, timeout=60)
    first = post(url, "/v1/completions").json()["usage"]
    again = post(url, "/v1/completions").json()["usage"]
    assert "prompt_tokens_details" not in first  # nothing cached yet
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < again["prompt_tokens"] and cached % 16 == 0
    stream = post(url, "/v1/completions", stream=True).text.splitlines()
    assert json.loads([x for x in stream if x.startswith("data: {")][-1][6:])["usage"]["prompt_tokens_details"] == {
        "cached_tokens": cached}
    messages = [{"role": "user", "content": prompt}]
    chat = [post(url, "/v1/chat/completions", messages=messages).json()["usage"] for _ in range(2)]
    assert chat[1]["prompt_tokens_details"]["cached_tokens"] > 0
    usage = server.client().chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2).usage
    again = server.client().chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2).usage
    assert usage.prompt_tokens_details is None and again.prompt_tokens_details is None  # the flag is off there


def test_cache_salt_keeps_the_cached_prefix_to_requests_of_the_same_salt(flagged):
    """vLLM's cache_salt (a fresh user's find: it was logged as ignored, every tenant's prefix open to all): a prompt
    cached under one salt is served from the cache only to requests sending the same salt, on both endpoints; a bad
    salt is a 400 naming it."""
    url, _ = flagged
    prompt = "eleven twelve thirteen fourteen fifteen sixteen " * 10
    post = lambda path, **kw: httpx.post(f"{url}{path}", json={"model": MODEL_NAME, "max_tokens": 2, **kw},
                                         headers=AUTH, timeout=60)
    cached = [post("/v1/completions", prompt=prompt, cache_salt=salt).json()["usage"].get("prompt_tokens_details")
              for salt in ("a", "a", "b")]
    assert cached[0] is None and cached[1]["cached_tokens"] > 0 and cached[2] is None
    messages = [{"role": "user", "content": prompt}]
    chat = [post("/v1/chat/completions", messages=messages, cache_salt=salt).json()["usage"].get("prompt_tokens_details")
            for salt in ("c", "d", "c")]
    assert chat[0] is None and chat[1] is None and chat[2]["cached_tokens"] > 0
    for bad in ("", 5):
        response = post("/v1/completions", prompt="Hi", cache_salt=bad)
        assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt", response.text


def test_chat_template_content_format_openai_gives_the_template_lists_of_text_parts(tiny_model_dir):
    """fresh-user report: vLLM's --chat-template-content-format was an unrecognized argument. With 'openai' the
    template gets each message's content as a list of text parts (a string content as one part)."""
    template = ("{% for m in messages %}{{ m['role'] }}:{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %};"
                "{% endfor %}")
    messages = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": [{"type": "text", "text": "b"}, {"type": "refusal", "refusal": "c"}]}]
    with cli_server(tiny_model_dir("qwen3"), "--chat-template", template,
                    "--chat-template-content-format", "openai") as (url, _, _app, _uv):
        ids = httpx.post(f"{url}/tokenize", json={"messages": messages, "add_generation_prompt": False},
                         headers=AUTH, timeout=60).json()["tokens"]
        text = httpx.post(f"{url}/detokenize", json={"tokens": ids}, headers=AUTH, timeout=60).json()["prompt"]
        assert text == "user:[a];assistant:[b][c];"
        assert _chat(url, messages=messages).json()["usage"]["prompt_tokens"] == len(ids)  # the template has no
        # generation prompt: the chat request renders the same text


def test_ssl_flags_serve_https_and_a_bad_file_is_refused_before_loading(tiny_model_dir, tmp_path):
    """fresh-user report: vLLM's --ssl-keyfile / --ssl-certfile were unrecognized arguments."""
    import shutil
    import subprocess

    from fxrewrite.cli import build_parser
    from fxrewrite.commands.serve import uvicorn_kwargs
    from fxrewrite.errors import UserInputError

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    with cli_server(tiny_model_dir("qwen3"), "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)) as (url, *_):
        https = url.replace("http://", "https://")
        got = httpx.get(f"{https}/v1/models", headers=AUTH, verify=str(cert), timeout=30)
        assert got.json()["data"][0]["id"] == MODEL_NAME
    for bad in (["--ssl-certfile", str(tmp_path / "missing.pem")], ["--ssl-certfile", str(key)],
                ["--ssl-keyfile", str(key)]):
        args = build_parser().parse_args(["serve", "m", *bad])
        with pytest.raises(UserInputError, match="--ssl-"):
            uvicorn_kwargs(args)
