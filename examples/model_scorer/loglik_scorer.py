"""A model-based reward served over `rollstream.v1.Reward/Score`: the built-in reward stage
calls it as its remote scorer (`python -m rollstream.reward --scorer-address host:port`, or
`rollstream up --reward.scorer-address host:port`).

It scores every completion with a causal language model: reward = exp(mean log-prob of the
completion's tokens under the model), in (0, 1], a fluency score. The same shape serves a
reward model or an LLM judge: load yours in `LogLikelihoodScorer.__init__`, compute a
number per item in `score_batch`. This process owns the GPU and the model; the reward stage
in front of it keeps the streams, batching, retries, circuit breaking and dead letters (see
docs/custom-reward.md, "Stream or Score").

    python loglik_scorer.py --model /path/to/hf-model --port 50061 [--device cuda]

Needs torch, transformers, grpcio and rollstream-core (for the generated stubs of
proto/rollstream/v1/reward.proto; generate your own with grpc_tools.protoc to drop it).
Nothing is downloaded: the model is a local Hugging Face folder.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollstream.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2

COMPONENT = "fluency"


class LogLikelihoodScorer(reward_pb2_grpc.RewardServicer):
    def __init__(self, model_dir: str, device: str, max_tokens: int):
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        self.device = device
        self.max_tokens = max_tokens
        # One forward at a time: the model and its device are the scarce resource; gRPC's
        # threads queue behind it (a caller's deadline bounds the wait).
        self.lock = threading.Lock()

    def Score(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext) -> reward_pb2.ScoreResponse:
        try:
            with self.lock:
                scores = self.score_batch([item.completion for item in request.items])
        except torch.cuda.OutOfMemoryError as e:  # transient: the reward stage retries, then holds its batch
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of device memory: {e}")
        return reward_pb2.ScoreResponse(scores=scores)

    def score_batch(self, texts: list[str]) -> list[reward_pb2.ItemScore]:
        """One forward over the batch, padded; each text scored on its own tokens only."""
        bos = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.tokenizer.eos_token_id
        rows = [[bos, *self.tokenizer(t, add_special_tokens=False)["input_ids"][: self.max_tokens]] for t in texts]
        out: list[reward_pb2.ItemScore | None] = [None] * len(rows)
        todo = [i for i, r in enumerate(rows) if len(r) > 1]
        for i, r in enumerate(rows):
            if len(r) <= 1:  # an empty completion: a verdict (0), said as such
                out[i] = reward_pb2.ItemScore(
                    reward=0.0,
                    components=[rollout_pb2.RewardComponent(name=COMPONENT, value=0.0, weight=1.0, status="ok")],
                )
        if todo:
            width = max(len(rows[i]) for i in todo)
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else bos
            ids = torch.full((len(todo), width), pad, dtype=torch.long)
            mask = torch.zeros((len(todo), width), dtype=torch.long)
            for k, i in enumerate(todo):
                ids[k, : len(rows[i])] = torch.tensor(rows[i])
                mask[k, : len(rows[i])] = 1
            with torch.no_grad():
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits.float()
            logp = (
                torch.log_softmax(logits[:, :-1], dim=-1)
                .gather(-1, ids[:, 1:].to(self.device).unsqueeze(-1))
                .squeeze(-1)
            )
            valid = mask[:, 1:].to(self.device).bool()
            for k, i in enumerate(todo):
                mean = float(logp[k][valid[k]].mean())
                reward = math.exp(mean) if math.isfinite(mean) else 0.0
                status = "ok" if math.isfinite(mean) else f"error: mean log-prob is {mean}"
                out[i] = reward_pb2.ItemScore(
                    reward=reward,
                    components=[rollout_pb2.RewardComponent(name=COMPONENT, value=reward, weight=1.0, status=status)],
                )
        return [s for s in out if s is not None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="local Hugging Face folder of a causal LM")
    parser.add_argument(
        "--host", default="127.0.0.1", help="bind address (loopback: only this machine's reward stage reaches it)"
    )
    parser.add_argument("--port", type=int, default=0, help="0: a free port (written to --port-file)")
    parser.add_argument("--port-file", default="", help="write the bound port here once serving")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--max-tokens", type=int, default=512, help="completion tokens scored per item (the rest is cut)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    scorer = LogLikelihoodScorer(args.model, args.device, args.max_tokens)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    reward_pb2_grpc.add_RewardServicer_to_server(scorer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    health_servicer.set("rollstream.v1.Reward", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    if args.port_file:
        Path(args.port_file).write_text(f"{port}\n")
    print(
        f"serving rollstream.v1.Reward on {args.host}:{port} (model {args.model}, {args.device})",
        file=sys.stderr,
        flush=True,
    )

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=5).wait()  # calls in flight finish
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
