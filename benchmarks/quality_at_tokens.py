"""Quality@Tokens plot of control ladder reports (benchmarks/control_ladder.py): end-to-end accuracy
(y, with its 95% interval) against mean tokens to answer (x, with its interval), one colour per
rung, a filled square for sampled runs and a hollow one for greedy. Written as a PNG with zlib
alone (the lent GPU machines have no plotting package); tick labels in a 3x5 pixel font, the
legend's boxes numbered in RUNGS order (1 baseline, 2 +phi, 3 +constraints, 4 +control-none,
5 +phi+efe, 6 +budget8, 7 +budget16, 8 +phi+efe+budget8, 9 +skip, 10 +skip-all, 11 +exit,
12 +exit-whole, 13 +phi+efe+exit, 14 +exit-first, 15 +all, 16 +gate).

    python benchmarks/quality_at_tokens.py ladder_heldout.json ladder_natural.json --png qat.png
"""

from __future__ import annotations

import argparse
import json
import struct
import zlib
from pathlib import Path

RUNGS = [
    "baseline",
    "+phi",
    "+constraints",
    "+control-none",
    "+phi+efe",
    "+budget8",
    "+budget16",
    "+phi+efe+budget8",
    "+skip",
    "+skip-all",
    "+exit",
    "+exit-whole",
    "+phi+efe+exit",
    "+exit-first",
    "+all",
    "+gate",
]
COLOURS = [
    (90, 90, 90),
    (230, 120, 20),
    (30, 110, 200),
    (120, 180, 230),
    (200, 30, 60),
    (40, 160, 70),
    (150, 210, 120),
    (140, 60, 170),
    (220, 190, 20),
    (110, 70, 30),
    (0, 170, 170),
    (90, 220, 220),
    (240, 90, 200),
    (160, 160, 60),
    (0, 0, 0),
    (255, 160, 160),
]
FONT = {  # 3x5 glyphs, rows top to bottom, 3 bits each
    "0": [7, 5, 5, 5, 7], "1": [2, 6, 2, 2, 7], "2": [7, 1, 7, 4, 7], "3": [7, 1, 7, 1, 7],
    "4": [5, 5, 7, 1, 1], "5": [7, 4, 7, 1, 7], "6": [7, 4, 7, 5, 7], "7": [7, 1, 1, 1, 1],
    "8": [7, 5, 7, 5, 7], "9": [7, 5, 7, 1, 7], ".": [0, 0, 0, 0, 2], "%": [5, 1, 2, 4, 5],
}  # fmt: skip
WIDTH, HEIGHT, MARGIN = 640, 420, 50


class Canvas:
    def __init__(self) -> None:
        self.pixels = bytearray(b"\xff" * (WIDTH * HEIGHT * 3))

    def dot(self, x: int, y: int, colour) -> None:
        if 0 <= x < WIDTH and 0 <= y < HEIGHT:
            at = (y * WIDTH + x) * 3
            self.pixels[at : at + 3] = bytes(colour)

    def line(self, x0, y0, x1, y1, colour) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(steps + 1):
            self.dot(round(x0 + (x1 - x0) * i / steps), round(y0 + (y1 - y0) * i / steps), colour)

    def box(self, x, y, half, colour, filled) -> None:
        for dx in range(-half, half + 1):
            for dy in range(-half, half + 1):
                if filled or abs(dx) == half or abs(dy) == half:
                    self.dot(x + dx, y + dy, colour)

    def text(self, x: int, y: int, text: str, scale: int = 2) -> None:
        for glyph in text:
            for row, bits in enumerate(FONT.get(glyph, [0] * 5)):
                for col in range(3):
                    if bits >> (2 - col) & 1:
                        for sx in range(scale):
                            for sy in range(scale):
                                self.dot(x + col * scale + sx, y + row * scale + sy, (0, 0, 0))
            x += 4 * scale

    def png(self) -> bytes:
        rows = b"".join(b"\x00" + self.pixels[y * WIDTH * 3 : (y + 1) * WIDTH * 3]
                        for y in range(HEIGHT))  # fmt: skip

        def chunk(kind: bytes, data: bytes) -> bytes:
            body = kind + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

        header = struct.pack(">IIBBBBB", WIDTH, HEIGHT, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
                + chunk(b"IEND", b""))  # fmt: skip


def plot(runs: list[dict]) -> bytes:
    canvas = Canvas()
    xs = [v for r in runs for v in r["tokens_ci"]]
    ys = [v for r in runs for v in r["end_to_end_ci"]]
    x_lo, x_hi = min(xs) - 2, max(xs) + 2
    y_lo, y_hi = max(0.0, min(ys) - 0.02), min(1.0, max(ys) + 0.02)

    def px(x: float) -> int:
        return round(MARGIN + (x - x_lo) / (x_hi - x_lo) * (WIDTH - 2 * MARGIN))

    def py(y: float) -> int:
        return round(HEIGHT - MARGIN - (y - y_lo) / (y_hi - y_lo) * (HEIGHT - 2 * MARGIN))

    black = (0, 0, 0)
    canvas.line(MARGIN, HEIGHT - MARGIN, WIDTH - MARGIN, HEIGHT - MARGIN, black)
    canvas.line(MARGIN, MARGIN, MARGIN, HEIGHT - MARGIN, black)
    for i in range(5):
        x = x_lo + (x_hi - x_lo) * i / 4
        y = y_lo + (y_hi - y_lo) * i / 4
        canvas.text(px(x) - 10, HEIGHT - MARGIN + 8, f"{x:.0f}")
        canvas.text(4, py(y) - 5, f"{100 * y:.0f}%")
    for r in runs:
        colour = COLOURS[RUNGS.index(r["rung"])]
        x, y = px(r["mean_tokens_to_answer"]), py(r["end_to_end_accuracy"])
        canvas.line(px(r["tokens_ci"][0]), y, px(r["tokens_ci"][1]), y, colour)
        canvas.line(x, py(r["end_to_end_ci"][0]), x, py(r["end_to_end_ci"][1]), colour)
        canvas.box(x, y, 4, colour, filled=r["mode"] != "greedy")
    for i, colour in enumerate(COLOURS):  # legend: rung number beside its colour
        canvas.box(WIDTH - MARGIN - 60, MARGIN + 16 * i, 5, colour, True)
        canvas.text(WIDTH - MARGIN - 48, MARGIN + 16 * i - 5, str(i + 1))
    return canvas.png()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+")
    parser.add_argument("--png", required=True)
    args = parser.parse_args()
    runs = [run for path in args.reports for run in json.loads(Path(path).read_text())["runs"]]
    Path(args.png).write_bytes(plot(runs))


if __name__ == "__main__":
    main()
