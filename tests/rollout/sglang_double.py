"""A contract double of an SGLang server, for the SGLang engine's tests: `python -m tests.rollout.sglang_double
--model DIR --port N`.

It serves the routes the engine uses with SGLang's documented request and response schemas (io_struct.py,
http_server.py): /health, /get_model_info, /server_info, /generate (input_ids, sampling_params, return_logprob;
meta_info.output_token_logprobs as [logprob, token id, text], meta_info.finish_reason {type, ...}),
/abort_request {rid | abort_all}, /pause_generation (in-flight requests end with finish_reason abort and the tokens
sampled so far; new ones wait for /continue_generation), /continue_generation, /update_weights_from_disk
{model_path}, /init_weights_update_group and /update_weights_from_distributed (a real broadcast over the group),
and /update_weights_from_tensor with a custom weight loader (`--custom-weight-loader`: the loader named as
`load_format` is imported and called with the model and the deserialized named tensors, as SGLang's model runner
does; the entry is read by an allowlist unpickler like SGLang's SafeUnpickler). The model the loader gets holds the
weights under SGLang's names and shapes (fused qkv_proj / gate_up_proj, the vocabulary padded to 64 rows), backed
by the same memory as the Hugging Face model the double generates with.
It generates for real with a tiny Hugging Face model (transformers, float32, one token at a time, no KV cache) and
refuses what SGLang refuses where the engine could get it wrong (top_k 0, text prompts).

It proves our side of the contract (what we send, how we read the replies, what we do around them), not SGLang's:
that SGLang still answers this way is checked only by bench/gpu_check.py on a GPU machine.
GET /double/state (not SGLang's) tells the tests what the double holds.
"""

from __future__ import annotations

import argparse
import base64
import glob
import importlib
import io
import json
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


class SGLangLayout:
    """The double's weights under SGLang's names and shapes (its Qwen3 / Llama): one fused qkv_proj ([q; k; v]
    rows) and gate_up_proj ([gate; up]) per layer, the embedding padded to a multiple of 64 rows. The Hugging Face
    projections and embedding become views of these tensors, so a write here changes what the double generates."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params: dict[str, torch.Tensor] = {}
        inner = model.model
        with torch.no_grad():
            vocab, hidden = inner.embed_tokens.weight.shape
            embed = torch.zeros(-(-vocab // 64) * 64, hidden)
            embed[:vocab] = inner.embed_tokens.weight
            inner.embed_tokens.weight = torch.nn.Parameter(embed[:vocab], requires_grad=False)
            if model.config.tie_word_embeddings:
                model.lm_head.weight = inner.embed_tokens.weight
            self.params["model.embed_tokens.weight"] = embed
            for i, layer in enumerate(inner.layers):
                fused = {"self_attn.qkv_proj": (layer.self_attn, ("q_proj", "k_proj", "v_proj")),
                         "mlp.gate_up_proj": (layer.mlp, ("gate_proj", "up_proj"))}
                for name, (parent, parts) in fused.items():
                    self.params[f"model.layers.{i}.{name}.weight"] = _fuse(parent, parts)
                taken = {f"{n.rpartition('.')[0]}.{p}.weight" for n, (_, ps) in fused.items() for p in ps}
                for name, param in layer.named_parameters():
                    if name not in taken:
                        self.params[f"model.layers.{i}.{name}"] = param.data
            self.params["model.norm.weight"] = inner.norm.weight.data
            if not model.config.tie_word_embeddings:
                self.params["lm_head.weight"] = model.lm_head.weight.data

    def named_parameters(self):
        return iter(self.params.items())


def _fuse(parent: torch.nn.Module, parts: tuple[str, ...]) -> torch.Tensor:
    fused = torch.cat([getattr(parent, p).weight for p in parts]).contiguous()
    offset = 0
    for p in parts:
        rows = getattr(parent, p).weight.shape[0]
        getattr(parent, p).weight = torch.nn.Parameter(fused[offset:offset + rows], requires_grad=False)
        offset += rows
    return fused


class _AllowlistUnpickler(pickle.Unpickler):
    """What SGLang's SafeUnpickler admits for plain tensors; anything else is refused."""

    ALLOWED = {("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "_load_from_bytes"),
               ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"blocked unsafe class loading ({module}.{name})")
        return super().find_class(module, name)


class Double:
    def __init__(self, model_path: str, token_delay: float, ignore_eos: bool = False,
                 custom_weight_loaders: tuple[str, ...] = ()) -> None:
        self.model_path = model_path
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.custom_weight_loaders = custom_weight_loaders
        self.sglang_layout = SGLangLayout(self.model) if custom_weight_loaders else None
        self.cache_flushes = 0
        self.eos = self.model.config.eos_token_id
        self.token_delay = token_delay
        self.ignore_eos = ignore_eos
        self.forward_lock = threading.Lock()
        self.state = threading.Condition()
        self.paused = False
        self.running: dict[str, bool] = {}      # rid -> aborted
        self.aborted_rids: list[str] = []
        self.weight_version = "default"
        self.updates = 0
        self.group = None
        self.generator = torch.Generator().manual_seed(0)

    # /generate ------------------------------------------------------------------------------------------------
    def generate(self, body: dict) -> tuple[int, dict]:
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            return 400, _error("input_ids: the double takes one prompt of token ids (no text)")
        sp = body.get("sampling_params") or {}
        temperature = float(sp.get("temperature", 1.0))
        top_k, top_p = int(sp.get("top_k", -1)), float(sp.get("top_p", 1.0))
        if top_k < -1 or top_k == 0:
            return 400, _error("top_k must be -1 (disable), or at least 1, got 0.")
        max_new = int(sp.get("max_new_tokens", 128))
        stops = set(sp.get("stop_token_ids") or ()) | ({self.eos} if not (sp.get("ignore_eos") or self.ignore_eos) else set())
        rid = body.get("rid") or f"double-{time.monotonic_ns()}"
        with self.state:
            while self.paused:
                self.state.wait()
            self.running[rid] = False
        out: list[int] = []
        logprobs: list[list] = []
        finish: dict = {"type": "length", "length": max_new}
        try:
            while len(out) < max_new:
                with self.state:
                    if self.running.get(rid):
                        finish = {"type": "abort", "message": "Abort in waiting queue", "status_code": 400}
                        break
                token, logprob = self._next_token(ids + out, temperature, top_k, top_p)
                out.append(token)
                logprobs.append([logprob, token, None])
                if token in stops:
                    finish = {"type": "stop", "matched": token}
                    break
                time.sleep(self.token_delay)
        finally:
            with self.state:
                self.running.pop(rid, None)
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(out),
                "cached_tokens": 0, "weight_version": self.weight_version}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = logprobs
        return 200, {"text": "", "output_ids": out, "meta_info": meta}

    @torch.no_grad()
    def _next_token(self, context: list[int], temperature: float, top_k: int, top_p: float) -> tuple[int, float]:
        with self.forward_lock:
            logits = self.model(input_ids=torch.tensor([context])).logits[0, -1].float()
        if temperature == 0:  # SGLang: greedy, log-prob under the plain softmax
            logp = torch.log_softmax(logits, -1)
            token = int(logits.argmax())
            return token, float(logp[token])
        logp = torch.log_softmax(logits / temperature, -1)
        probs = logp.exp()
        if top_k > 0:
            probs[probs < torch.topk(probs, min(top_k, probs.numel())).values[-1]] = 0
        if top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            cut = sorted_probs.cumsum(0) - sorted_probs > top_p
            probs[order[cut]] = 0
        token = int(torch.multinomial(probs / probs.sum(), 1, generator=self.generator))
        return token, float(logp[token])

    # control ----------------------------------------------------------------------------------------------------
    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        with self.state:
            for r in self.running:
                if abort_all or r == rid:
                    self.running[r] = True
                    self.aborted_rids.append(r)

    def pause(self) -> None:
        with self.state:
            self.paused = True
        self.abort(abort_all=True)

    def resume(self) -> None:
        with self.state:
            self.paused = False
            self.state.notify_all()

    def load(self, tensors: dict[str, torch.Tensor], version) -> None:
        known = dict(self.model.named_parameters())
        unknown = sorted(set(tensors) - set(known))
        if unknown:
            raise ValueError(f"unknown parameters {unknown[:4]}")
        with self.forward_lock, torch.no_grad():
            for name, t in tensors.items():
                known[name].copy_(t.to(known[name].dtype))
        self.weight_version = str(version) if version is not None else self.weight_version
        self.updates += 1

    def update_from_disk(self, body: dict) -> tuple[int, dict]:
        try:
            files = sorted(glob.glob(f"{body['model_path']}/*.safetensors"))
            if not files:
                raise ValueError(f"no *.safetensors in {body['model_path']}")
            tensors: dict[str, torch.Tensor] = {}
            for f in files:
                tensors.update(load_file(f))
            self.load(tensors, body.get("weight_version"))
        except Exception as exc:  # noqa: BLE001 - SGLang answers failures with success false
            return 400, {"success": False, "message": f"Failed to update weights: {exc}", "num_paused_requests": 0}
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def update_from_tensor(self, body: dict) -> tuple[int, dict]:
        fmt = body.get("load_format")
        if fmt not in self.custom_weight_loaders:
            return 400, {"success": False, "message": f"Unknown load_format={fmt} (custom weight loaders: "
                                                      f"{list(self.custom_weight_loaders)})"}
        entries = body.get("serialized_named_tensors") or []
        if len(entries) != 1:
            return 400, {"success": False, "message": f"expected one entry per TP rank (tp_size 1), got {len(entries)}"}
        try:
            named = _AllowlistUnpickler(io.BytesIO(base64.b64decode(entries[0], validate=True))).load()
        except Exception as exc:  # noqa: BLE001 - SGLang's request fails
            return 400, {"success": False, "message": f"deserialize: {exc}"}
        module, _, func = fmt.rpartition(".")
        with self.forward_lock:
            getattr(importlib.import_module(module), func)(self.sglang_layout, named)
        if body.get("flush_cache", True):
            self.cache_flushes += 1
        self.updates += 1
        return 200, {"success": True, "message": "Succeeded to update model weights."}

    def init_group(self, body: dict) -> tuple[int, dict]:
        from services.rollout.engines.sglang_weights import open_group

        try:
            self.group = open_group(body["master_address"], int(body["master_port"]), rank=int(body["rank_offset"]),
                                    world_size=int(body["world_size"]), backend=body.get("backend", "nccl"),
                                    group_name=body.get("group_name", "weight_update_group"), timeout=60)
        except Exception as exc:  # noqa: BLE001
            return 400, {"success": False, "message": f"Failed to init group: {exc}"}
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_from_distributed(self, body: dict) -> tuple[int, dict]:
        from services.rollout.engines.sglang_weights import receive_tensors

        try:
            specs = list(zip(body["names"], body["dtypes"], body["shapes"], strict=True))
            self.load(receive_tensors(self.group, specs, "cpu"), body.get("weight_version"))
        except Exception as exc:  # noqa: BLE001
            return 400, {"success": False, "message": f"Failed to update parameter online: {exc}"}
        return 200, {"success": True, "message": "Succeeded to update parameter online."}


def _error(message: str) -> dict:
    return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}


def serve(double: Double, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _reply(self, status: int, body=None) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._reply(200)
            elif self.path == "/get_model_info":
                self._reply(200, {"model_path": double.model_path, "tokenizer_path": double.model_path,
                                  "is_generation": True, "preferred_sampling_params": None,
                                  "weight_version": double.weight_version})
            elif self.path == "/server_info":
                self._reply(200, {"tp_size": 1, "pp_size": 1, "dp_size": 1, "model_path": double.model_path,
                                  "context_length": double.model.config.max_position_embeddings,
                                  "internal_states": [], "version": "contract-double"})
            elif self.path == "/double/state":
                with double.state:
                    self._reply(200, {"running": len(double.running), "aborted_rids": list(double.aborted_rids),
                                      "paused": double.paused, "weight_version": double.weight_version,
                                      "updates": double.updates, "cache_flushes": double.cache_flushes})
            else:
                self._reply(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}") if length else {}
            if self.path == "/generate":
                self._reply(*double.generate(body))
            elif self.path == "/abort_request":
                double.abort(body.get("rid", ""), bool(body.get("abort_all", False)))
                self._reply(200)
            elif self.path == "/pause_generation":
                double.pause()
                self._reply(200, {"message": "Generation paused successfully.", "status": "ok"})
            elif self.path == "/continue_generation":
                double.resume()
                self._reply(200, {"message": "Generation continued successfully.", "status": "ok"})
            elif self.path == "/update_weights_from_disk":
                self._reply(*double.update_from_disk(body))
            elif self.path == "/update_weights_from_tensor":
                self._reply(*double.update_from_tensor(body))
            elif self.path == "/init_weights_update_group":
                self._reply(*double.init_group(body))
            elif self.path == "/update_weights_from_distributed":
                self._reply(*double.update_from_distributed(body))
            else:
                self._reply(404, {"detail": "Not Found"})

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--token-delay", type=float, default=0.0, help="seconds between tokens (time to interrupt)")
    ap.add_argument("--ignore-eos", action="store_true", help="as if every request set ignore_eos (long runs)")
    ap.add_argument("--custom-weight-loader", nargs="*", default=[], help="as SGLang's: loaders /update_weights_from_tensor may name")
    args = ap.parse_args()
    torch.set_num_threads(1)
    server = serve(Double(args.model, args.token_delay, args.ignore_eos, tuple(args.custom_weight_loader)), args.host,
                   args.port)
    server.serve_forever()


if __name__ == "__main__":
    main()
