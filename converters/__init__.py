"""Checkpoint formats in and out, all speaking HF tensor names (`tensor_source.TensorSource`).

tensor_source   the TensorSource protocol, DictTensorSource, the checks every reader and
                writer applies (names/shapes/dtypes against a config, finite values)
hf              Hugging Face safetensors folders: HFFolderSource (read), write_hf_folder (write),
                and the one safetensors header parser (scan_/read_safetensors_header)
fp8_block       FP8 block-scaled sources (DeepSeek-V3's weight_scale_inv): config, scale pairing,
                the dequantization hf's reader applies
maxtext         MaxText (Orbax) checkpoints: MaxTextSource (read), write_maxtext (write)
layout          the one HF <-> MaxText name and transform table both directions use
maxtext_models  MaxText model names -> HF configs and RoPE layouts
convert         `nvfp4tool convert`: detect the source format, dispatch, summarise
atomic          atomic_output_dir: build an output folder in a temporary sibling, rename at the
                end; refuse outputs overlapping an input; clean what a killed run left
"""
