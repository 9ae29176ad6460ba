"""Fast CPU inference for our cross-encoders: the backbone on ONNX Runtime or OpenVINO, fp32 or int8, while pooling and
head stay in torch (so ``predict(pairs, return_std=True)``, VarCE Eq. 22-23, works on every backend); for a
split-attention cross-encoder the backbone is its whole pair path (:class:`_SplitFunction`). Exports are made
once, atomically, in the model folder (sentence-transformers' layout), anew when the torch weights change; details
and why not Optimum: ``docs/varce.md`` (fast CPU inference)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch
from sentence_transformers import CrossEncoder
from sentence_transformers.base.modules import Transformer
from torch import nn

from st_extensions.atomic import atomic_write, locked
from st_extensions.checks import choice, positive_int
from st_extensions.cross_encoder.split import (
    BIAS_FILE,
    JOINT_STATES,
    QUERY_MASK,
    SCORE_SEPARATOR,
    SEPARATE,
    SEPARATE_FILE,
    SplitTransformer,
)
from st_extensions.frozen import evaluating
from st_extensions.loading import load_model

__all__ = ["BACKENDS", "PRECISIONS", "RuntimeBackbone", "RuntimeSplit", "export_backbone", "load_cross_encoder"]

logger = logging.getLogger(__name__)

Backend = Literal["torch", "onnx", "openvino"]
Precision = Literal["fp32", "int8"]
BACKENDS: tuple[str, ...] = ("torch", "onnx", "openvino")
PRECISIONS: tuple[str, ...] = ("fp32", "int8")

#: where each export lives inside the model folder (sentence-transformers' layout and file names)
FILES: dict[tuple[str, str], str] = {
    ("onnx", "fp32"): "onnx/model.onnx",
    ("onnx", "int8"): "onnx/model_qint8_avx2.onnx",
    ("openvino", "fp32"): "openvino/openvino_model.xml",
    ("openvino", "int8"): "openvino/openvino_model_qint8_quantized.xml",
}
INFO_FILE = "export_info.json"
#: the ONNX opset of the exports (ONNX Runtime's BERT fusions and integer ops are written for it)
ONNX_OPSET = 17
#: the encoder inputs an export takes, in this order, where the tokenizer produces them
INPUT_NAMES: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids")
#: the inputs of a split-attention cross-encoder's export (:meth:`SplitTransformer.preprocess`'s), in this order: the
#: query's tokens, the document's and, for a model that reads the first stage's score as text, the score's
SPLIT_INPUT_NAMES: tuple[str, ...] = (
    "input_ids", "attention_mask", "document_input_ids", "document_attention_mask", "score_input_ids",
    "score_attention_mask",
)  # fmt: skip
#: its outputs: each joint layer's states (J, B, T, H), the joint sequence's mask and query tokens, and the bi-encoder
#: path's states where the model has one
SPLIT_OUTPUT_NAMES: tuple[str, ...] = ("joint_layer_states", "joint_attention_mask", "query_token_mask", "separate")
#: calibration pairs used at most for OpenVINO int8 (sentence-transformers' calibration set has 300 samples)
MAX_CALIBRATION_PAIRS = 300
#: exports of encoders with more weight bytes than this keep them in a file beside the ``.onnx`` (protobuf's 2 GB)
_EXTERNAL_DATA_BYTES = 1_500_000_000

_EXTRAS = {
    "onnx": "pip install 'pyterrier-prob[onnx]' (onnxruntime, onnx, onnxscript)",
    "openvino": "pip install 'pyterrier-prob[openvino]' (openvino, nncf, onnx, onnxscript)",
}


def _check_choices(backend: Any, precision: Any) -> tuple[str, str]:
    """``backend`` and ``precision`` (either case) checked and lower-cased."""
    backend = choice("backend", backend.lower() if isinstance(backend, str) else backend, BACKENDS)
    precision = choice("precision", precision.lower() if isinstance(precision, str) else precision, PRECISIONS)
    if backend == "torch" and precision != "fp32":
        raise ValueError(
            f"precision={precision!r} needs backend='onnx' or 'openvino' (the torch backend runs the saved fp32 "
            "weights as they are)"
        )
    return backend, precision


def _require(backend: str, precision: str, packages: Sequence[str]) -> None:
    """An ImportError naming the extra to install when one of ``packages`` is missing."""
    for name in packages:
        try:
            __import__(name)
        except ImportError as e:
            raise ImportError(
                f"backend={backend!r} (precision={precision!r}) needs the package {name!r}, which is not installed: "
                f"{_EXTRAS[backend]}"
            ) from e


class _EncoderFunction(nn.Module):
    """The Hugging Face encoder as ``(input_ids, attention_mask[, token_type_ids]) -> last_hidden_state``."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        return self.encoder(**{k: v for k, v in inputs.items() if v is not None}, return_dict=True).last_hidden_state


class _SplitFunction(nn.Module):
    """A :class:`SplitTransformer`'s pair path as one function of the tokenised pairs (:data:`SPLIT_INPUT_NAMES`) ->
    :data:`SPLIT_OUTPUT_NAMES`: the lower layers on each text apart, the joint layers on the pair, the bi path."""

    def __init__(self, split: SplitTransformer) -> None:
        super().__init__()
        self.split = split

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        document_input_ids: torch.Tensor,
        document_attention_mask: torch.Tensor,
        score_input_ids: torch.Tensor | None = None,
        score_attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        given = dict(zip(SPLIT_INPUT_NAMES, (input_ids, attention_mask, document_input_ids, document_attention_mask)))
        if score_input_ids is not None:
            given |= {"score_input_ids": score_input_ids, "score_attention_mask": score_attention_mask}
        hidden, mask, is_query = self.split.joint_inputs(given)
        states: list[torch.Tensor] = []
        self.split.run_joint(hidden, mask, is_query, outputs=states)
        out = (torch.stack(states), mask, (mask.bool() & is_query).long())
        if self.split.separate is not None:
            out += (self.split.run_separate(hidden, mask, is_query),)
        return out


def _backbone(model: CrossEncoder) -> Transformer:
    """The model's first module, checked to be a text feature-extraction ``Transformer`` (or a split-attention one) on
    torch."""
    first = model[0] if len(model) else None
    if not isinstance(first, Transformer) or first.transformer_task != "feature-extraction":
        raise ValueError(
            "load_cross_encoder needs a cross-encoder whose first module is a feature-extraction Transformer "
            "(build_cross_encoder / build_var_cross_encoder); got "
            f"{type(first).__name__ if first is not None else 'no module'}"
        )
    if isinstance(first, SplitTransformer):
        if first.state_cache is not None:
            raise ValueError("a SplitTransformer with a layer-state cache runs on torch: export the model as saved")
        return first
    text = first.modality_config.get("text", {})
    if text.get("method") != "forward" or text.get("method_output_name") not in ("last_hidden_state",):
        raise ValueError(f"the backbone's text modality must run forward -> last_hidden_state, got {text}")
    return first


def _input_names(model: CrossEncoder) -> tuple[str, ...]:
    return SPLIT_INPUT_NAMES if isinstance(model[0], SplitTransformer) else INPUT_NAMES


def _example_inputs(model: CrossEncoder) -> dict[str, torch.Tensor]:
    """Two pairs tokenised as ``predict`` does, the shorter padded (each text of a split model: its query, document and
    score): the export traces the attention-mask path."""
    pairs = [("query one two", "a document of some words"), ("query", "document")]
    if isinstance(model[0], SplitTransformer) and model[0].score_segment:
        pairs = [(q, f"{s}{SCORE_SEPARATOR}{d}") for (q, d), s in zip(pairs, ("12.75", "3"))]
    features = model.preprocess(pairs)
    names = [n for n in _input_names(model) if n in features]
    if "input_ids" not in names or "attention_mask" not in names:
        raise ValueError(f"the tokenizer gives {sorted(features)}; an export needs input_ids and attention_mask")
    return {n: features[n].to("cpu") for n in names}


def _drop_quantizer_advice(record: logging.LogRecord) -> bool:
    """ONNX Runtime's quantiser advises (on the root logger) a pre-processing that Optimum does not run either."""
    return not str(record.msg).startswith("Please consider to run pre-processing before quantization")


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Keep the exporters' notes (skipped torchvision ops, progress, deprecations inside torch) out of the log."""
    names = ("torch.onnx", "torch.export", "torch._dynamo", "torch.fx", "onnxscript")
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    logging.getLogger().addFilter(_drop_quantizer_advice)
    try:
        with warnings.catch_warnings():
            # the tracer's notes on BERT's mask code: the padding branch it freezes is never taken for an encoder (key
            # length = mask length), the index op's negative indices do not occur (tests compare on padded batches)
            for category in (FutureWarning, DeprecationWarning, torch.jit.TracerWarning):
                warnings.simplefilter("ignore", category)
            warnings.filterwarnings("ignore", message="Exporting aten::index operator", category=UserWarning)
            yield
    finally:
        logging.getLogger().removeFilter(_drop_quantizer_advice)
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)


@contextlib.contextmanager
def _eager_attention(encoder: nn.Module, extra: nn.Module | None = None) -> Iterator[None]:
    """Eager attention while exporting: its MatMul-Softmax-MatMul is what ONNX Runtime fuses (SDPA's graph is not);
    ``extra``: layers copied out of the encoder (a split model's bi-encoder path), whose configs are their own."""
    configs = {id(c): c for m in (extra.modules() if extra is not None else ()) if (c := getattr(m, "config", None))}
    saved = {k: c._attn_implementation for k, c in configs.items() if hasattr(c, "_attn_implementation")}
    for k in saved:
        configs[k]._attn_implementation = "eager"
    before = getattr(getattr(encoder, "config", None), "_attn_implementation", None)
    setter = getattr(encoder, "set_attn_implementation", None)
    change = setter is not None and before not in (None, "eager")
    if change:
        setter("eager")
    try:
        yield
    finally:
        if change:
            setter(before)
        for k, value in saved.items():
            configs[k]._attn_implementation = value


def _weight_files(path: str) -> list[str]:
    """The files of the backbone's torch weights and config (the Transformer module sits at the model's root)."""
    return sorted(
        name
        for name in os.listdir(path)
        if name in ("config.json", BIAS_FILE, SEPARATE_FILE)  # a split model's cross bias and bi-encoder path
        or (name.startswith("model") and name.endswith((".safetensors", ".safetensors.json")))
    )


def _weights_stat(path: str) -> list[list[Any]]:
    """``[name, size, mtime_ns]`` of each weight file: a cheap first check before hashing."""
    return [[n, (st := os.stat(os.path.join(path, n))).st_size, st.st_mtime_ns] for n in _weight_files(path)]


def _weights_sha256(path: str) -> str:
    digest = hashlib.sha256()
    for name in _weight_files(path):
        digest.update(name.encode() + b"\0")
        with open(os.path.join(path, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _read_info(folder: str) -> dict[str, Any]:
    try:
        with open(os.path.join(folder, INFO_FILE), encoding="utf8") as f:
            info = json.load(f)
        return info if isinstance(info, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}


def _is_fresh(path: str, rel: str, sha: dict[str, str]) -> bool:
    """Whether the export ``rel`` exists and was made from the current weights (one without a record is trusted)."""
    file = os.path.join(path, rel)
    if not os.path.isfile(file) or (file.endswith(".xml") and not os.path.isfile(file[:-4] + ".bin")):
        return False
    record = _read_info(os.path.dirname(file)).get(os.path.basename(file))
    if not isinstance(record, dict) or "weights_sha256" not in record:
        return True
    if record.get("weights_stat") == _weights_stat(path):
        return True
    if "value" not in sha:
        sha["value"] = _weights_sha256(path)
    return record["weights_sha256"] == sha["value"]


@contextlib.contextmanager
def _locked(folder: str, shared: bool = False) -> Iterator[None]:
    """Flock ``folder/.export.lock``: exclusive to write (makes the folder); shared to read (no .xml + new .bin)."""
    if not shared:
        try:
            os.makedirs(folder, exist_ok=True)
            open(os.path.join(folder, ".export.lock"), "ab").close()
        except PermissionError as e:
            raise PermissionError(
                f"cannot write into {folder!r} ({e.strerror}): the first load of a model on a backend exports its "
                "backbone into the model folder, which must then be writable (or load a copy of the model)"
            ) from e
    with locked(os.path.join(folder, ".export.lock"), shared=shared):
        yield


def _install(tmp: str, folder: str, main: str) -> None:
    """Move ``tmp``'s files into ``folder`` (fsync, 0644, ``os.replace``), ``main`` last: its companions come first."""
    names = sorted(os.listdir(tmp), key=lambda n: (n == main, n))
    if main not in names:
        raise RuntimeError(f"the exporter wrote no {main!r} (wrote {names})")
    for name in names:
        src = os.path.join(tmp, name)
        if not os.path.isfile(src):
            continue
        with open(src, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(src, 0o644)
        os.replace(src, os.path.join(folder, name))


def _record(path: str, rel: str, extra: dict[str, Any]) -> None:
    folder, name = os.path.split(os.path.join(path, rel))
    info = _read_info(folder)
    stamp = {"weights_sha256": _weights_sha256(path), "weights_stat": _weights_stat(path), "torch": torch.__version__}
    info[name] = {**stamp, **extra}
    atomic_write(os.path.join(folder, INFO_FILE), lambda f: f.write(json.dumps(info, indent=2).encode("utf8")))


def _export_onnx_fp32(path: str, model: CrossEncoder, tmp: str, main: str, pairs: Any) -> dict[str, Any]:
    transformer = _backbone(model)
    example = _example_inputs(model)
    if isinstance(transformer, SplitTransformer):  # the whole pair path: lower layers apart, joint layers, bi path
        function, module, encoder = _SplitFunction(transformer), transformer, transformer.auto_model
        outputs = list(SPLIT_OUTPUT_NAMES[: 3 + (transformer.separate is not None)])
        side = {n: n.split("_")[0] if n.startswith(("document_", "score_")) else "query" for n in example}
        axes = {n: {0: "batch_size", 1: f"{side[n]}_length"} for n in example}
        axes |= {n: {0: "batch_size", 1: "pair_length"} for n in outputs[1:]}
        axes[outputs[0]] = {1: "batch_size", 2: "pair_length"}
    else:
        encoder = module = transformer.model
        function, outputs = _EncoderFunction(encoder), ["last_hidden_state"]
        axes = {name: {0: "batch_size", 1: "sequence_length"} for name in [*example, *outputs]}
    weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    with (
        evaluating(module),
        torch.no_grad(),
        _quiet_exporter(),
        _eager_attention(encoder, getattr(transformer, "separate", None)),
        open(os.devnull, "w") as null,
        contextlib.redirect_stdout(null),
    ):
        # the TorchScript exporter: its BERT graph is the one ONNX Runtime fuses and quantises (docs/varce.md)
        torch.onnx.export(
            function,
            (),
            os.path.join(tmp, main),
            kwargs=example,
            dynamo=False,
            input_names=list(example),
            output_names=outputs,
            dynamic_axes=axes,
            opset_version=ONNX_OPSET,
            external_data=weight_bytes > _EXTERNAL_DATA_BYTES,
        )
    exporter = f"torch.onnx.export(dynamo=False, opset {ONNX_OPSET}), eager attention"
    return {"exporter": exporter, "inputs": list(example), "outputs": outputs}


def _export_onnx_int8(path: str, model: Any, tmp: str, main: str, pairs: Any) -> dict[str, Any]:
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.registry import IntegerOpsRegistry

    source = os.path.join(path, FILES["onnx", "fp32"])
    # signed int8 weights per channel, uint8 activations at run time: the fast u8s8 kernels on AVX2 (docs/varce.md)
    with _quiet_exporter():
        quantize_dynamic(
            source,
            os.path.join(tmp, main),
            op_types_to_quantize=list(IntegerOpsRegistry),
            per_channel=True,
            reduce_range=False,
            weight_type=QuantType.QInt8,
            use_external_data_format=os.path.exists(source + ".data"),  # the fp32 export keeps its weights beside it
            extra_options={"WeightSymmetric": True, "ActivationSymmetric": False, "EnableSubgraph": False},
        )
    return {"quantization": "onnxruntime.quantize_dynamic (QInt8 weights, symmetric, per channel; UInt8 activations)"}


def _export_openvino_fp32(path: str, model: Any, tmp: str, main: str, pairs: Any) -> dict[str, Any]:
    import openvino as ov

    converted = ov.convert_model(os.path.join(path, FILES["onnx", "fp32"]))
    ov.save_model(converted, os.path.join(tmp, main), compress_to_fp16=False)
    return {"exporter": f"openvino.convert_model({FILES['onnx', 'fp32']})"}


def _calibration_items(model: CrossEncoder, pairs: Sequence[Sequence[str]]) -> list[dict[str, np.ndarray]]:
    pairs = list(pairs)[:MAX_CALIBRATION_PAIRS]
    for pair in pairs:
        if isinstance(pair, str) or len(pair) != 2 or not all(isinstance(t, str) for t in pair):
            raise ValueError(f"calibration_pairs must be (query, document) pairs of str, got {pair!r:.80}")
    features = [model.preprocess([tuple(pair)]) for pair in pairs]
    return [{n: f[n].numpy() for n in _input_names(model) if n in f} for f in features]


def _pairs_sha256(pairs: Sequence[Sequence[str]]) -> str:
    digest = hashlib.sha256()
    for q, d in list(pairs)[:MAX_CALIBRATION_PAIRS]:
        digest.update(q.encode() + b"\0" + d.encode() + b"\0")
    return digest.hexdigest()


def _export_openvino_int8(
    path: str, model: CrossEncoder, tmp: str, main: str, pairs: Sequence[Sequence[str]] | None
) -> dict[str, Any]:
    import nncf  # export_backbone has checked that there are calibration pairs
    import openvino as ov

    items = _calibration_items(model, pairs)
    # the defaults of Optimum Intel's OVQuantizationConfig() (what sentence-transformers' static export uses)
    quantized = nncf.quantize(
        ov.Core().read_model(os.path.join(path, FILES["openvino", "fp32"])),
        nncf.Dataset(items),
        preset=nncf.QuantizationPreset.MIXED,
        model_type=nncf.ModelType.TRANSFORMER,
        subset_size=len(items),
        fast_bias_correction=True,
        advanced_parameters=nncf.AdvancedQuantizationParameters(overflow_fix=nncf.OverflowFix.DISABLE),
    )
    ov.save_model(quantized, os.path.join(tmp, main), compress_to_fp16=False)
    return {
        "quantization": "nncf.quantize (static int8, mixed preset, transformer model type)",
        "calibration_pairs": len(items),
        "calibration_sha256": _pairs_sha256(pairs),
    }


#: per export: the export it is made from (None: the torch encoder), the packages making it needs and how it is made
#: (``(model folder, torch model, temporary folder, file name, calibration pairs) -> record``)
_STEPS: dict[tuple[str, str], tuple[tuple[str, str] | None, tuple[str, ...], Callable[..., dict[str, Any]]]] = {
    ("onnx", "fp32"): (None, ("onnx", "onnxscript"), _export_onnx_fp32),
    ("onnx", "int8"): (("onnx", "fp32"), ("onnxruntime", "onnx"), _export_onnx_int8),
    ("openvino", "fp32"): (("onnx", "fp32"), ("openvino",), _export_openvino_fp32),
    ("openvino", "int8"): (("openvino", "fp32"), ("openvino", "nncf"), _export_openvino_int8),
}


def export_backbone(
    path: str | os.PathLike,
    backend: Backend,
    precision: Precision = "fp32",
    *,
    model: CrossEncoder | None = None,
    calibration_pairs: Sequence[Sequence[str]] | None = None,
) -> str:
    """Make the export that :func:`load_cross_encoder` runs (``backend`` onnx / openvino, ``precision``) once; its path.
    A fresh export (of the current torch weights) is kept, a missing or stale one written atomically, the chain torch ->
    ONNX fp32 -> {ONNX int8, OpenVINO fp32 -> OpenVINO int8} made as far as needed (``docs/varce.md``). ``model``:
    ``path``'s model on torch (else loaded); ``calibration_pairs``: (query, document) pairs (first 300), needed when
    OpenVINO int8 is made. ValueError for bad choices or torch; ImportError naming the extra to install."""
    path = os.path.abspath(os.fspath(path))
    backend, precision = _check_choices(backend, precision)
    if backend == "torch":
        raise ValueError("backend='torch' needs no export: pass backend='onnx' or 'openvino'")
    rel, sha = FILES[backend, precision], {}
    target = os.path.join(path, rel)
    folder, main = os.path.split(target)
    if _is_fresh(path, rel, sha):
        recorded = (_read_info(folder).get(main) or {}).get("calibration_sha256")  # openvino int8 only
        if calibration_pairs and recorded is not None and recorded != _pairs_sha256(calibration_pairs):
            logger.warning(
                "%s was calibrated on other pairs than the calibration_pairs given; it is used as it is (delete it to "
                "calibrate anew)",
                target,
            )
        return target
    if (backend, precision) == ("openvino", "int8") and not calibration_pairs:
        raise ValueError(  # before exporting anything
            "backend='openvino', precision='int8' quantises statically and needs calibration data the first time: "
            "pass calibration_pairs=[(query, document), ...] (up to 300 pairs like those you will score; "
            "sentence-transformers' static export would download GLUE/SST-2 instead: offline unreachable, and single "
            "sentences)"
        )
    steps, step = [], (backend, precision)
    while step is not None and (step == (backend, precision) or not _is_fresh(path, FILES[step], {})):
        steps.append(step)
        step = _STEPS[step][0]
    _require(backend, precision, sorted({name for st in steps for name in _STEPS[st][1]}))
    source, _, make = _STEPS[backend, precision]
    if source is not None:  # made from another export: make that one first
        export_backbone(path, *source, model=model)
    if model is None and (backend, precision) in (("onnx", "fp32"), ("openvino", "int8")):
        model = _load_torch(path)  # to trace the encoder / to tokenise the calibration pairs
    with _locked(folder):
        if _is_fresh(path, rel, sha):  # another process made it while this one waited
            return target
        if os.path.exists(target):
            logger.warning("%s was made from other torch weights than %s's: exporting it anew", rel, path)
        logger.info("exporting the backbone of %s to %s (%s)", path, rel, precision)
        with tempfile.TemporaryDirectory(prefix=".export-", dir=folder, ignore_cleanup_errors=True) as tmp:
            extra = make(path, model, tmp, main, calibration_pairs)
            _install(tmp, folder, main)
            _record(path, rel, extra)
    return target


class RuntimeBackbone(nn.Module):
    """Stands in for the Hugging Face encoder in a ``Transformer``: runs an ONNX Runtime session or OpenVINO compiled
    model on ``file`` returning ``{"last_hidden_state": float32 CPU tensor}``; ``config``: the encoder's. Unsaveable."""

    def __init__(
        self,
        file: str,
        backend: str,
        precision: str,
        config: Any,
        num_threads: int,
        known_inputs: Sequence[str] = INPUT_NAMES,
    ) -> None:
        super().__init__()
        self.file, self.backend, self.precision, self.config = file, backend, precision, config
        self.num_threads = int(num_threads)
        if backend == "onnx":
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.intra_op_num_threads = self.num_threads
            options.inter_op_num_threads = 1
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            options.log_severity_level = 3
            self._session = ort.InferenceSession(file, options, providers=["CPUExecutionProvider"])
            self.input_names = tuple(i.name for i in self._session.get_inputs())
        elif backend == "openvino":
            import openvino as ov

            hints = {"INFERENCE_NUM_THREADS": self.num_threads, "PERFORMANCE_HINT": "LATENCY"}
            compiled = ov.Core().compile_model(file, "CPU", {**hints, "INFERENCE_PRECISION_HINT": "f32"})
            self._request = compiled.create_infer_request()
            self.input_names = tuple(p.get_any_name() for p in compiled.inputs)
        else:
            raise ValueError(f"backend must be 'onnx' or 'openvino', got {backend!r}")
        if unknown := sorted(set(self.input_names) - set(known_inputs)):
            raise ValueError(f"{file} takes inputs {unknown} that a cross-encoder's tokenizer does not give")

    def run(self, given: dict[str, Any]) -> list[np.ndarray]:
        """The graph's outputs, in order, for the tensors ``given`` by input name."""
        if missing := [name for name in self.input_names if given.get(name) is None]:
            raise ValueError(f"{self.file} needs the input {missing[0]!r}, which the tokenizer did not give")
        feeds = {n: np.ascontiguousarray(given[n].detach().cpu().numpy(), dtype=np.int64) for n in self.input_names}
        if self.backend == "onnx":
            return self._session.run(None, feeds)
        outputs = self._request.infer(feeds, share_inputs=True, share_outputs=False)
        return [outputs[i] for i in range(len(outputs))]

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        given = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        out = self.run(given)[0]
        return {"last_hidden_state": torch.from_numpy(np.asarray(out, dtype=np.float32))}

    def save_pretrained(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"this cross-encoder's backbone runs on {self.backend} ({self.file}) and cannot be saved: save the torch "
            "model (st_extensions.load_model(path)) instead"
        )

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, precision={self.precision!r}, file={self.file!r}, threads={self.num_threads}"


class RuntimeSplit(RuntimeBackbone):
    """A split-attention cross-encoder's pair path on a runtime (:class:`_SplitFunction`'s export): tokenised pairs ->
    the :class:`SplitTransformer` outputs the interaction and head read (its ``runtime``)."""

    def __init__(self, file: str, backend: str, precision: str, config: Any, num_threads: int) -> None:
        super().__init__(file, backend, precision, config, num_threads, known_inputs=SPLIT_INPUT_NAMES)

    def forward(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        out = [torch.from_numpy(np.asarray(x)) for x in self.run(features)]
        states = out[0].float()
        result = {JOINT_STATES: list(states.unbind(0)), "token_embeddings": states[-1]}
        result |= {"attention_mask": out[1].long(), QUERY_MASK: out[2].long()}
        if len(out) > 3:
            result[SEPARATE] = out[3].float()
        return result


def _load_torch(path: str, device: str | None = "cpu") -> CrossEncoder:
    model = load_model(path, device=device)
    if not isinstance(model, CrossEncoder):
        raise ValueError(
            f"{path!r} holds a {type(model).__name__}, not a cross-encoder: load_cross_encoder loads models saved by "
            "build_cross_encoder / build_var_cross_encoder (+ training)"
        )
    return model


def load_cross_encoder(
    path: str | os.PathLike,
    backend: Backend = "torch",
    precision: Precision = "fp32",
    device: str | torch.device | None = "cpu",
    *,
    num_threads: int | None = None,
    calibration_pairs: Sequence[Sequence[str]] | None = None,
) -> CrossEncoder:
    """Load a saved cross-encoder (plain or :class:`~st_extensions.cross_encoder.VarCrossEncoder`) with its backbone on
    ``backend`` (``"torch"``, or ``"onnx"`` / ``"openvino"`` on CPU) in ``precision`` (``"fp32"``; ``"int8"``: onnx
    dynamic, openvino static on ``calibration_pairs``); pooling and head stay in torch (``predict(pairs,
    return_std=True)``, Eq. 22-23). A split-attention model runs its pair path (lower layers on each text apart, joint
    layers, bi-encoder path) on the runtime. The first load exports the backbone into the (writable) model folder
    (:func:`export_backbone`); ``num_threads`` defaults to ``torch.get_num_threads()``. Returns the model in eval mode
    (not saveable with a runtime backbone)."""
    backend, precision = _check_choices(backend, precision)
    path = os.path.abspath(os.fspath(path))
    positive_int("num_threads", num_threads, allow_none=True)
    if backend == "torch":
        return _load_torch(path, device=None if device is None else str(device)).eval()
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"device must be 'cpu' for backend={backend!r} (got {device!r}): the runtimes here run on CPU")
    _require(backend, precision, ["onnxruntime" if backend == "onnx" else "openvino"])  # what running it needs
    model = _load_torch(path, device="cpu")
    transformer = _backbone(model)  # refuses a model it cannot export before anything is written
    file = export_backbone(path, backend, precision, model=model, calibration_pairs=calibration_pairs)
    threads = num_threads or max(1, torch.get_num_threads())
    with _locked(os.path.dirname(file), shared=True):  # no writer replaces the files while they are read
        kind = RuntimeSplit if isinstance(transformer, SplitTransformer) else RuntimeBackbone
        runtime = kind(file, backend, precision, transformer.model.config, threads)
    if isinstance(transformer, SplitTransformer):
        transformer.runtime = runtime  # pairs run on it; single texts (never scored) stay on torch
    else:
        transformer.model = runtime  # the torch encoder is dropped: the runtime replaces it
        transformer.backend = backend
    # BaseModel.save would write the folder's configs before the Transformer refused: refuse before anything
    model.save = model.save_pretrained = runtime.save_pretrained  # type: ignore[method-assign]
    return model.eval()
