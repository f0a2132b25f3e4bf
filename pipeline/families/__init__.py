"""Each model family in one folder, ``pipeline/families/<family>/``: its entry ``FAMILY`` (``spec.ModelFamily``),
its model-side parts (``parts``: the model put to the uses the commands ask of it, an evaluation scorer, a
generation decoder, a finetuning encoder) and its Hugging Face exporter and verifier (``hf``), over its model in
models/. ``pipeline.job.families`` registers them; the generic halves (windows, sampling, heads, HF directories) live
in the modules that ask the spec, which a family folder never imports.
"""
