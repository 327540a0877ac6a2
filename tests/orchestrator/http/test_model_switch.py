"""A request whose `model` differs from the one that served the conversation so far follows the model-swap
rules (a router's cost-quality cascade seen from the HTTP side): under a key the session switches model."""

from __future__ import annotations

import pytest

from tests.orchestrator.http.conftest import MODEL, start_http_node

OTHER = "v41-sib-l"


@pytest.mark.slow
def test_a_cascade_to_the_sibling_switches_the_sessions_model(tmp_path) -> None:
    node = start_http_node(tmp_path, models=(MODEL, OTHER))
    try:
        client = node.client()
        messages = [
            {"role": "system", "content": "You fix bugs. " * 20},
            {"role": "user", "content": "Fix it."},
        ]
        first = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, prompt_cache_key="cascade"
        )
        ext = first.model_extra["kvresume"]
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Again, carefully."},
        ]
        second = client.chat.completions.create(
            model=OTHER, messages=messages, max_tokens=8, temperature=0, prompt_cache_key="cascade"
        )
        ext2 = second.model_extra["kvresume"]
        assert (ext2["session_id"], ext2["new_session"], ext2["model"]) == (ext["session_id"], False, OTHER)
        # no validated mapper ships between the siblings: the receiver prefills cold, and says why
        assert ext2["path"] in ("RESUME_PATH_MODEL_SWAP", "RESUME_PATH_COLD_PREFILL"), ext2
        if ext2["path"] == "RESUME_PATH_COLD_PREFILL":
            assert second.usage.prompt_tokens_details.cached_tokens == 0 and MODEL in ext2["reason"], ext2
        assert second.usage.prompt_tokens == sum(ext2["counts"][k] for k in ("cached", "mapped", "prefilled"))
    finally:
        node.stop()
