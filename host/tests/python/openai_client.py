"""The official `openai` Python client against `specula serve`.

Usage: python3 openai_client.py BASE_URL MODEL [API_KEY]

BASE_URL is the daemon's address (http://127.0.0.1:PORT); MODEL a profile it serves whose
sampling defaults to greedy; API_KEY the key the daemon requires, if any (then a wrong key
must fail with the client's AuthenticationError). Completes, chats and streams (both endpoints), checks that the
streamed text equals the non-streamed text, that `usage` and the `speculative` statistics
arrive, and that errors surface as the client's typed exceptions. Exits non-zero on failure.
"""

import sys

import openai
from openai import OpenAI


def main() -> None:
    base_url, model = sys.argv[1], sys.argv[2]
    api_key = sys.argv[3] if len(sys.argv) > 3 else "not-needed"
    client = OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=60)

    if len(sys.argv) > 3:
        wrong = OpenAI(base_url=f"{base_url}/v1", api_key="sk-wrong", max_retries=0, timeout=60)
        try:
            wrong.models.list()
            raise AssertionError("a wrong API key was accepted")
        except openai.AuthenticationError as e:
            assert e.status_code == 401 and e.code == "invalid_api_key", e

    ids = [m.id for m in client.models.list().data]
    assert model in ids, ids
    assert client.models.retrieve(model).id == model
    try:
        client.models.retrieve("no-such-model")
        raise AssertionError("an unknown model was retrieved")
    except openai.NotFoundError as e:
        assert e.status_code == 404, e

    # Completion.
    c = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=24, temperature=0
    )
    text = c.choices[0].text
    assert text.startswith(", there was"), text
    assert c.choices[0].finish_reason == "length", c
    assert c.usage.completion_tokens == 24, c.usage
    assert c.usage.total_tokens == c.usage.prompt_tokens + 24, c.usage
    spec = c.to_dict()["speculative"]
    assert spec["emitted"] == 24 and "acceptance_by_position" in spec, spec

    # Streamed completion: the same text, usage in the last chunk.
    pieces, last = [], None
    for chunk in client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=24, temperature=0, stream=True
    ):
        pieces.append(chunk.choices[0].text)
        last = chunk
    assert "".join(pieces) == text, ("".join(pieces), text)
    assert last.choices[0].finish_reason == "length", last
    assert last.usage.completion_tokens == 24, last
    assert "speculative" in last.to_dict(), last

    # Chat, with a stop string.
    messages = [
        {"role": "system", "content": "You tell short stories."},
        {"role": "user", "content": "Tell me about Lily."},
    ]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=20, temperature=0, seed=3
    )
    reply = chat.choices[0].message
    assert reply.role == "assistant", reply
    assert reply.content, chat
    assert chat.usage.completion_tokens <= 20, chat.usage
    assert "speculative" in chat.to_dict(), chat

    # Streamed chat: role first, then content deltas, then the finish reason with usage.
    roles, deltas, finish, usage = [], [], None, None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=20,
        temperature=0,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            if choice.delta.content:
                deltas.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    assert roles == ["assistant"], roles
    assert "".join(deltas) == reply.content, ("".join(deltas), reply.content)
    assert finish == chat.choices[0].finish_reason, (finish, chat)
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens, usage

    # Errors arrive as the client's typed exceptions.
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert e.status_code == 404 and "no-such-model" in str(e), e
    try:
        client.completions.create(model=model, prompt="x", max_tokens=-1)
        raise AssertionError("a negative max_tokens was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and "max_tokens" in str(e), e

    print(f"openai {openai.__version__}: completion {text!r}; chat {reply.content!r}")


if __name__ == "__main__":
    main()
