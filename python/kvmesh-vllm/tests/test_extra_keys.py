"""The connector's event extra keys equal vLLM's for every case of ``hash_extra_keys.json``
(computed by vLLM's own ``to_event_extra_keys``; no server)."""

from __future__ import annotations

import json
import os

from kvmesh_vllm.extra_keys import event_extra_keys

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hash_extra_keys.json")


def test_event_extra_keys_match_vllms_for_salt_and_lora():
    with open(FIXTURE) as f:
        cases = json.load(f)["cases"]
    assert len(cases) == 24
    for case in cases:
        lora = case["lora"]["name"] if case["lora"] else None
        got = [event_extra_keys(lora, case["cache_salt"], i) for i in range(len(case["blocks"]))]
        want = [tuple(k) if k is not None else None for k in case["event_extra_keys"]]
        assert got == want, case["name"]
