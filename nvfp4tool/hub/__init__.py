"""Publish a checked export to the Hugging Face Hub with its proof (model card + validation).

result = push_checkpoint("out/llama-nvfp4", PushOptions(repo_id="org/llama-nvfp4", dry_run=True))
print(result.file_table()); print(result.card)

card     build_model_card: README.md metadata and sections from the export's configs,
         provenance record and validation report
custody  verify_custody / verify_claims: the files and source push uploads are the ones
         validation.json validated, and the record agrees with itself and the export
upload   push_checkpoint: custody -> check -> validation gate -> card -> create_repo / upload_folder
"""

from __future__ import annotations

from nvfp4tool.hub.card import build_model_card
from nvfp4tool.hub.upload import PushOptions, PushResult, format_size, push_checkpoint

__all__ = ["PushOptions", "PushResult", "build_model_card", "format_size", "push_checkpoint"]
