"""`sandgate run`'s main job: config.py (the options as one value, checked), build.py (every part,
built in one function with its collaborators passed in), serve.py (start serving, run, stop)."""
