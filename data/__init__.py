"""nanolap's data: importable loaders (images, text) and the augmentation that runs on the training device
(augment). Each data/<name>/prepare.py is a command that writes a dataset to disk."""
