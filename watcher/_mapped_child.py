"""Run as a script by :class:`watcher.hashing.MappedHasher`: hash descriptors it is sent.

It maps each file and hashes it on blake3's AUTO threads. If the file is
truncated while mapped, the kernel sends SIGBUS and this process dies; the
daemon sees the socket close and treats the file as changed. Only the standard
library and blake3 are imported, so it starts fast.
"""

import mmap
import os
import socket
import sys

import blake3


def serve(sock: socket.socket) -> None:
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 16, 1)
        except OSError:
            return
        if not msg or not fds:
            return
        fd = fds[0]
        try:
            size = os.fstat(fd).st_size
            hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
            if size:
                with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
                    hasher.update(mapped)
            reply = f"ok {hasher.hexdigest()} {size}"
        except (OSError, ValueError) as e:
            reply = f"err {e}"
        finally:
            os.close(fd)
        sock.send(reply.encode())


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
