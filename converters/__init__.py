"""Checkpoint formats in and out, all speaking HF tensor names (`tensor_source.TensorSource`).

    tensor_source  the TensorSource protocol, DictTensorSource, the shape check against a config
    hf             Hugging Face safetensors folders: HFFolderSource (read), write_hf_folder (write)
    atomic         atomic_output_dir: build an output folder in a temporary sibling, rename at the end
"""
