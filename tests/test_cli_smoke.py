import subprocess
import sys


def test_help_lists_commands_without_cuda():
    out = subprocess.run([sys.executable, "-m", "ds4py", "--help"], capture_output=True, text=True, check=True)
    assert "DeepSeek" in out.stdout


def test_import_does_not_load_cuda():
    code = "import sys, ds4py, ds4py.model; assert not any(m.startswith('cuda') for m in sys.modules), sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
