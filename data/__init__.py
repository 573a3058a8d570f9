"""nanolap's data: importable loaders (images, text) and the augmentation that runs on the training device
(augment). Each data/<name>/prepare.py is a command that writes a dataset to disk."""

import os
import shutil
import socket
from contextlib import contextmanager

DOWNLOAD_TIMEOUT = 30  # seconds a download may wait for the server's next bytes: offline, it fails instead of hanging


@contextmanager
def download_timeout(folder=None):
    """torchvision and tiktoken download without a timeout: a connection dropped without a word would wait forever.
    Inside the block every new socket gives up after DOWNLOAD_TIMEOUT seconds of silence. A block that fails removes
    the folders it made on the way to `folder`, with what it wrote there: no empty data/cifar10/ is left behind."""
    path = os.path.abspath(folder) if folder else None
    made = None  # the outermost folder on the way to `folder` that does not exist yet
    while path and not os.path.exists(path):
        made = path
        path = os.path.dirname(path)
    found = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT)
    try:
        yield
    except BaseException:
        if made:
            shutil.rmtree(made, ignore_errors=True)
        raise
    finally:
        socket.setdefaulttimeout(found)
