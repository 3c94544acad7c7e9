"""An object store on 127.0.0.1 that takes uploads (HTTP PUT) at a limited
rate, like a remote bucket behind a slow link. Prints its port, then serves
until killed.

    python slow_store.py --rate 2000000
"""

import argparse
import http.server
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rate", type=float, default=2_000_000, help="bytes per second")
    a = p.parse_args()
    chunk = 64 * 1024

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):
            length = int(self.headers["Content-Length"])
            got = 0
            while got < length:
                data = self.rfile.read(min(chunk, length - got))
                if not data:
                    break
                got += len(data)
                time.sleep(len(data) / a.rate)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
