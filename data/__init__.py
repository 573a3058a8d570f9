"""nanolap's data: importable loaders (images, text) and the augmentation that runs on the training device
(augment). Each data/<name>/prepare.py is a command that writes a dataset to disk."""

import socket
from contextlib import contextmanager

DOWNLOAD_TIMEOUT = 30  # seconds a download may wait for the server's next bytes: offline, it fails instead of hanging


@contextmanager
def download_timeout():
    """torchvision and tiktoken download without a timeout: a connection dropped without a word would wait forever.
    Inside the block every new socket gives up after DOWNLOAD_TIMEOUT seconds of silence."""
    found = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT)
    try:
        yield
    finally:
        socket.setdefaulttimeout(found)
