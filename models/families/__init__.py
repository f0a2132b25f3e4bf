"""Each model family's model-side parts, one module per family: its model put to the uses the commands ask of it (an
evaluation scorer, a generation decoder, a finetuning encoder). ``pipeline.job.families`` holds them in the family's
spec as real callables; the generic halves (windows, sampling, heads) live above, in pipeline/ and finetune/.
"""
