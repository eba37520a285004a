"""ForwardBlock (a forward model built from blocks) and TrainingBlock (its training and eval models, with the
gradient from onnxopt's rules), as ``onnxruntime.training.onnxblock``'s."""

from __future__ import annotations

import copy

import onnx

from onnxopt.compat.onnxruntime_training.onnxblock import blocks


def register_graph_outputs(model: onnx.ModelProto, output_names) -> None:
    """Makes ``output_names`` the graph outputs (replacing the others), typed by shape inference."""
    names = [output_names] if isinstance(output_names, str) else list(output_names)
    outputs = []
    for name in names:
        found = blocks.find_value(model, name)
        if found is None:
            raise LookupError(f"The provided name {name} is not a graph value info or a graph output.")
        outputs.append(copy.deepcopy(found))
    del model.graph.output[:]
    model.graph.output.extend(outputs)


class ForwardBlock(blocks.Block):
    """Subclasses' ``build`` returns the name(s) of the new graph output(s); ``to_model_proto()`` the model."""

    def __init__(self):
        super().__init__()
        self._model = None

    def to_model_proto(self) -> onnx.ModelProto:
        if self._model is None:
            raise RuntimeError("Please build the forward models first before trying to retrieve it.")
        return self._model

    def __call__(self, *args, **kwargs):
        self.base = blocks._ACCESSOR[-1].model if blocks._ACCESSOR else None
        if self.base is None:
            raise RuntimeError(f"{type(self).__name__}: call blocks inside `with onnxblock.base(model):`")
        output = self.build(*args, **kwargs)
        self._model = self.infer_shapes_on_base()
        register_graph_outputs(self._model, output)
        # NOTE: onnxruntime-training 1.19 loads IR <= 10; a base made with onnx.IR_VERSION of onnx >= 1.17 is newer
        self._model.ir_version = min(self._model.ir_version, 10)
        self.base.CopyFrom(self._model)
        return output


class TrainingBlock(blocks.Block):
    """Subclasses' ``build`` returns the loss's name; calling the block builds the training model (gradient
    buffers, ``lazy_reset_grad``, ``<name>_grad.accumulation.out``) and the eval model for the parameters and
    inputs marked ``requires_grad`` (none by default), as ``artifacts.generate_artifacts`` writes them."""

    def __init__(self):
        super().__init__()
        self._requires_grad: list[str] = []
        self._frozen_params: list[str] = []
        self._parameters = self._training_model = self._eval_model = None

    def requires_grad(self, argument_name: str, value: bool = True) -> None:
        for names in (self._requires_grad, self._frozen_params):
            if argument_name in names:
                names.remove(argument_name)
        (self._requires_grad if value else self._frozen_params).append(argument_name)

    def parameters(self) -> tuple[list[onnx.TensorProto], list[onnx.TensorProto]]:
        if self._parameters is None:
            raise RuntimeError("Please build the training model first before trying to retrieve the parameters.")
        return self._parameters

    def to_model_proto(self) -> tuple[onnx.ModelProto, onnx.ModelProto]:
        if self._training_model is None or self._eval_model is None:
            raise RuntimeError("Please build the training and eval models first before trying to retrieve them.")
        return self._training_model, self._eval_model

    def __call__(self, *args, **kwargs):
        from onnxopt.compat.onnxruntime_training import artifacts
        from onnxopt.fuse import run_part

        self.base = blocks._ACCESSOR[-1].model if blocks._ACCESSOR else None
        if self.base is None:
            raise RuntimeError(f"{type(self).__name__}: call blocks inside `with onnxblock.base(model):`")
        output = self.build(*args, **kwargs)
        model = self.infer_shapes_on_base()
        register_graph_outputs(model, output)
        inits = {i.name: i for i in model.graph.initializer}
        self._parameters = ([inits[n] for n in inits if n in self._requires_grad],
                            [inits[n] for n in inits if n in self._frozen_params])
        # NOTE: the compiler's load stage: the default opset raised to what onnxopt's gradient rules write
        loss_model = run_part(model, ("load",), gradient="onnxopt").model
        grads = [n for n in self._requires_grad if n in inits or n in {i.name for i in model.graph.input}]
        frozen = [n for n in self._frozen_params if n in inits]
        self._training_model = artifacts.training_model(loss_model, grads, frozen, [])
        self._eval_model = artifacts.eval_model(loss_model, [n for n in inits if n in grads or n in frozen])
        self.base.CopyFrom(self._training_model)
        return output
