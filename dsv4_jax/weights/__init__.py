"""Weights I/O: the checkpoint format (`checkpoint`: names, dtypes, shapes, the safetensors
reader), `load_model` (`loading`), the converted-weights cache (`converted_cache`, in folders
written through `partial_dirs`), random checkpoints (`random_checkpoint`) and the built-in model
made from one (`builtin`). How the model holds its weights on the device (FP8 blocks, MXFP4) is
the model's own: `dsv4_jax.model.weight_formats`."""
