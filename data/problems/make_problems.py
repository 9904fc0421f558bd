#!/usr/bin/env python3
"""Writes problems.jsonl and function_problems.jsonl: rlloop's small self-written problem set.

Every problem has hand-written tests (expected outputs worked out by hand, not by running the solution) and a
reference solution; tests/sandbox checks that each reference passes its tests in the sandbox, which
cross-checks both. Edit this file, then run: python3 data/problems/make_problems.py
"""
import json, os

HERE = os.path.dirname(os.path.abspath(__file__))
P = []

def io(task_id, statement, tests, solution, language="python"):
    P.append({"task_id": task_id, "prompt": statement, "language": language,
              "tests": [{"input": i, "output": o} for i, o in tests], "solution": solution})

io("cp/sum-two", "Read two integers a and b and print a+b.",
   [("1 2\n", "3\n"), ("-5 5\n", "0\n"), ("1000000000 1000000000\n", "2000000000\n")],
   "a, b = map(int, input().split())\nprint(a + b)\n")
io("cp/max-of-list", "The first line has n, the second n integers. Print the largest.",
   [("3\n1 9 4\n", "9\n"), ("1\n-7\n", "-7\n"), ("5\n-1 -2 -3 -4 -5\n", "-1\n")],
   "n = int(input())\nprint(max(map(int, input().split())))\n")
io("cp/reverse-string", "Read a line and print it reversed.",
   [("hello\n", "olleh\n"), ("a\n", "a\n"), ("abc def\n", "fed cba\n")],
   "print(input()[::-1])\n")
io("cp/count-vowels", "Read a line of lowercase letters and spaces; print how many vowels (aeiou) it has.",
   [("hello world\n", "3\n"), ("rhythm\n", "0\n"), ("aeiou\n", "5\n")],
   "print(sum(c in 'aeiou' for c in input()))\n")
io("cp/fizzbuzz", "Read n and print the numbers 1..n one per line, but Fizz for multiples of 3, Buzz for multiples of 5 and FizzBuzz for both.",
   [("5\n", "1\n2\nFizz\n4\nBuzz\n"), ("15\n", "1\n2\nFizz\n4\nBuzz\nFizz\n7\n8\nFizz\nBuzz\n11\nFizz\n13\n14\nFizzBuzz\n"), ("1\n", "1\n")],
   "n = int(input())\nfor i in range(1, n + 1):\n    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else i)\n")
io("cp/factorial", "Read n (0 <= n <= 20) and print n!.",
   [("0\n", "1\n"), ("5\n", "120\n"), ("20\n", "2432902008176640000\n")],
   "import math\nprint(math.factorial(int(input())))\n")
io("cp/fibonacci", "Read n (0 <= n <= 90) and print the n-th Fibonacci number (F0=0, F1=1).",
   [("0\n", "0\n"), ("10\n", "55\n"), ("90\n", "2880067194370816120\n")],
   "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nprint(a)\n")
io("cp/is-prime", "Read n (1 <= n <= 10^12) and print YES if it is prime, NO otherwise.",
   [("1\n", "NO\n"), ("2\n", "YES\n"), ("97\n", "YES\n"), ("1000000000039\n", "YES\n"), ("999999999999\n", "NO\n")],
   "n = int(input())\ndef prime(n):\n    if n < 2: return False\n    i = 2\n    while i * i <= n:\n        if n % i == 0: return False\n        i += 1\n    return True\nprint('YES' if prime(n) else 'NO')\n")
io("cp/gcd", "Read two positive integers and print their greatest common divisor.",
   [("12 18\n", "6\n"), ("7 13\n", "1\n"), ("100 100\n", "100\n")],
   "import math\na, b = map(int, input().split())\nprint(math.gcd(a, b))\n")
io("cp/palindrome", "Read a word and print YES if it reads the same backwards, NO otherwise.",
   [("racecar\n", "YES\n"), ("ab\n", "NO\n"), ("x\n", "YES\n")],
   "s = input().strip()\nprint('YES' if s == s[::-1] else 'NO')\n")
io("cp/sort-numbers", "The first line has n, the second n integers. Print them in increasing order, space separated.",
   [("4\n3 1 2 1\n", "1 1 2 3\n"), ("1\n5\n", "5\n"), ("3\n-1 10 -20\n", "-20 -1 10\n")],
   "input()\nprint(*sorted(map(int, input().split())))\n")
io("cp/word-count", "Read a line and print how many words (maximal runs of non-space characters) it has.",
   [("the quick brown fox\n", "4\n"), ("  spaced   out  \n", "2\n"), ("one\n", "1\n")],
   "print(len(input().split()))\n")
io("cp/average", "The first line has n, the second n integers. Print their average with exactly 2 digits after the point.",
   [("3\n1 2 4\n", "2.33\n"), ("2\n1 2\n", "1.50\n"), ("1\n-3\n", "-3.00\n")],
   "n = int(input())\nxs = list(map(int, input().split()))\nprint(f'{sum(xs) / n:.2f}')\n")
io("cp/circle-area", "Read a radius r (a real number) and print the area of the circle (pi r^2); answers within 1e-6 are accepted.",
   [("1\n", "3.141592653589793\n"), ("2.5\n", "19.634954084936208\n"), ("0\n", "0\n")],
   "import math\nr = float(input())\nprint(math.pi * r * r)\n")
io("cp/binary", "Read a non-negative integer and print it in binary without leading zeros.",
   [("0\n", "0\n"), ("5\n", "101\n"), ("255\n", "11111111\n")],
   "print(bin(int(input()))[2:])\n")
io("cp/digit-sum", "Read a non-negative integer (up to 100 digits) and print the sum of its digits.",
   [("0\n", "0\n"), ("12345\n", "15\n"), ("9999999999\n", "90\n")],
   "print(sum(int(c) for c in input().strip()))\n")
io("cp/second-largest", "The first line has n >= 2, the second n integers with at least two distinct values. Print the second largest distinct value.",
   [("4\n1 3 3 2\n", "2\n"), ("2\n5 -5\n", "-5\n"), ("5\n7 7 7 1 7\n", "1\n")],
   "input()\nxs = sorted(set(map(int, input().split())))\nprint(xs[-2])\n")
io("cp/count-distinct", "The first line has n, the second n integers. Print how many distinct values there are.",
   [("5\n1 2 2 3 3\n", "3\n"), ("1\n0\n", "1\n"), ("4\n-1 1 -1 1\n", "2\n")],
   "input()\nprint(len(set(input().split())))\n")
io("cp/matrix-trace", "The first line has n; then n lines of n integers. Print the sum of the main diagonal.",
   [("2\n1 2\n3 4\n", "5\n"), ("1\n-9\n", "-9\n"), ("3\n1 0 0\n0 1 0\n0 0 1\n", "3\n")],
   "n = int(input())\nprint(sum(list(map(int, input().split()))[i] for i in range(n)))\n")
io("cp/anagram", "Read two words on one line and print YES if they are anagrams of each other, NO otherwise.",
   [("listen silent\n", "YES\n"), ("abc abd\n", "NO\n"), ("a aa\n", "NO\n")],
   "a, b = input().split()\nprint('YES' if sorted(a) == sorted(b) else 'NO')\n")
io("cp/caesar", "Read k (0..25) on the first line and a lowercase word on the second; print the word with each letter shifted k places forward (z wraps to a).",
   [("1\nabc\n", "bcd\n"), ("3\nxyz\n", "abc\n"), ("0\nhello\n", "hello\n")],
   "k = int(input())\nprint(''.join(chr((ord(c) - 97 + k) % 26 + 97) for c in input().strip()))\n")
io("cp/leap-year", "Read a year and print YES if it is a leap year in the Gregorian calendar, NO otherwise.",
   [("2000\n", "YES\n"), ("1900\n", "NO\n"), ("2024\n", "YES\n"), ("2023\n", "NO\n")],
   "y = int(input())\nprint('YES' if y % 400 == 0 or (y % 4 == 0 and y % 100 != 0) else 'NO')\n")
io("cp/triangle-type", "Read three positive integers, the sides of a valid triangle. Print equilateral, isosceles or scalene.",
   [("2 2 2\n", "equilateral\n"), ("3 4 3\n", "isosceles\n"), ("3 4 5\n", "scalene\n")],
   "s = set(input().split())\nprint({1: 'equilateral', 2: 'isosceles', 3: 'scalene'}[len(s)])\n")
io("cp/prefix-sums", "The first line has n, the second n integers. Print the n running totals, space separated.",
   [("3\n1 2 3\n", "1 3 6\n"), ("1\n5\n", "5\n"), ("4\n1 -1 1 -1\n", "1 0 1 0\n")],
   "import itertools\ninput()\nprint(*itertools.accumulate(map(int, input().split())))\n")
io("cp/balanced-brackets", "Read a string of the characters ()[]{} and print YES if the brackets are balanced, NO otherwise.",
   [("([]{})\n", "YES\n"), ("([)]\n", "NO\n"), ("((\n", "NO\n"), ("\n", "YES\n")],
   "s = input().strip()\nst = []\npairs = {')': '(', ']': '[', '}': '{'}\nok = True\nfor c in s:\n    if c in '([{': st.append(c)\n    elif not st or st.pop() != pairs[c]:\n        ok = False\n        break\nprint('YES' if ok and not st else 'NO')\n")
io("cp/power-mod", "Read a, b, m and print a^b mod m (0 <= a, b <= 10^18, 1 <= m <= 10^9).",
   [("2 10 1000\n", "24\n"), ("3 0 7\n", "1\n"), ("123456789 1000000000000000000 1000000007\n", "%d\n" % pow(123456789, 10**18, 10**9 + 7))],
   "a, b, m = map(int, input().split())\nprint(pow(a, b, m))\n")
io("cp/collatz-steps", "Read n >= 1 and print how many Collatz steps (n -> n/2 if even, 3n+1 if odd) it takes to reach 1.",
   [("1\n", "0\n"), ("6\n", "8\n"), ("27\n", "111\n")],
   "n = int(input())\nc = 0\nwhile n != 1:\n    n = n // 2 if n % 2 == 0 else 3 * n + 1\n    c += 1\nprint(c)\n")
# C++ references: the sandbox compiles them with g++.
io("cp/cpp-sum-array", "The first line has n, the second n integers (each |x| <= 10^9). Print their sum.",
   [("3\n1 2 3\n", "6\n"), ("2\n1000000000 1000000000\n", "2000000000\n"), ("1\n-4\n", "-4\n")],
   "#include <iostream>\nint main() {\n  int n;\n  std::cin >> n;\n  long long s = 0, x;\n  for (int i = 0; i < n; ++i) { std::cin >> x; s += x; }\n  std::cout << s << '\\n';\n}\n",
   language="cpp")
io("cp/cpp-count-primes", "Read n (1 <= n <= 10^6) and print how many primes are <= n.",
   [("1\n", "0\n"), ("10\n", "4\n"), ("1000000\n", "78498\n")],
   "#include <iostream>\n#include <vector>\nint main() {\n  int n;\n  std::cin >> n;\n  std::vector<bool> comp(n + 1);\n  int c = 0;\n  for (long long i = 2; i <= n; ++i) {\n    if (comp[i]) continue;\n    ++c;\n    for (long long j = i * i; j <= n; j += i) comp[j] = true;\n  }\n  std::cout << c << '\\n';\n}\n",
   language="cpp")
io("cp/cpp-reverse-words", "Read a line of words and print the words in reverse order, separated by single spaces.",
   [("a b c\n", "c b a\n"), ("hello\n", "hello\n"), ("one two\n", "two one\n")],
   "#include <iostream>\n#include <string>\n#include <vector>\nint main() {\n  std::vector<std::string> w;\n  std::string s;\n  while (std::cin >> s) w.push_back(s);\n  for (std::size_t i = w.size(); i-- > 0;) std::cout << w[i] << (i ? ' ' : '\\n');\n}\n",
   language="cpp")
io("cp/cpp-lcm", "Read two positive integers (up to 10^9) and print their least common multiple.",
   [("4 6\n", "12\n"), ("7 5\n", "35\n"), ("1000000000 999999999\n", "999999999000000000\n")],
   "#include <iostream>\n#include <numeric>\nint main() {\n  long long a, b;\n  std::cin >> a >> b;\n  std::cout << a / std::gcd(a, b) * b << '\\n';\n}\n",
   language="cpp")

F = []
def fn(task_id, prompt, entry_point, solution, test):
    F.append({"task_id": task_id, "prompt": prompt, "entry_point": entry_point,
              "canonical_solution": solution, "test": test})

fn("fn/add", 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n', "add", "    return a + b\n",
   "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n    assert candidate(10**20, 1) == 10**20 + 1\n")
fn("fn/is-palindrome", 'def is_palindrome(s: str) -> bool:\n    """True when s reads the same backwards."""\n', "is_palindrome",
   "    return s == s[::-1]\n",
   "def check(candidate):\n    assert candidate('abba')\n    assert not candidate('ab')\n    assert candidate('')\n")
fn("fn/running-max", 'from typing import List\n\ndef running_max(xs: List[int]) -> List[int]:\n    """The maximum of each prefix: running_max([1, 3, 2]) == [1, 3, 3]."""\n',
   "running_max", "    out, m = [], None\n    for x in xs:\n        m = x if m is None else max(m, x)\n        out.append(m)\n    return out\n",
   "def check(candidate):\n    assert candidate([1, 3, 2]) == [1, 3, 3]\n    assert candidate([]) == []\n    assert candidate([-5, -6, 0]) == [-5, -5, 0]\n")
fn("fn/count-words", 'from typing import Dict\n\ndef count_words(text: str) -> Dict[str, int]:\n    """How often each whitespace-separated word occurs."""\n',
   "count_words", "    d = {}\n    for w in text.split():\n        d[w] = d.get(w, 0) + 1\n    return d\n",
   "def check(candidate):\n    assert candidate('a b a') == {'a': 2, 'b': 1}\n    assert candidate('') == {}\n")
fn("fn/flatten", 'def flatten(xs):\n    """Flatten arbitrarily nested lists: flatten([1, [2, [3]]]) == [1, 2, 3]."""\n', "flatten",
   "    out = []\n    for x in xs:\n        if isinstance(x, list):\n            out.extend(flatten(x))\n        else:\n            out.append(x)\n    return out\n",
   "def check(candidate):\n    assert candidate([1, [2, [3]]]) == [1, 2, 3]\n    assert candidate([]) == []\n    assert candidate([[[]]]) == []\n")
fn("fn/median", 'def median(xs):\n    """Median of a non-empty list of numbers (mean of the two middle ones for even length)."""\n', "median",
   "    s = sorted(xs)\n    n = len(s)\n    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2\n",
   "def check(candidate):\n    assert candidate([3, 1, 2]) == 2\n    assert candidate([4, 1, 3, 2]) == 2.5\n    assert candidate([7]) == 7\n")

def write(name, rows):
    with open(os.path.join(HERE, name), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")

write("problems.jsonl", P)
write("function_problems.jsonl", F)
print(f"{len(P)} stdin/stdout problems, {len(F)} function problems")
