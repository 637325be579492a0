"""Write a tiny random-weight Llama chat model, fully offline.

Used by ``brownout make-tiny-model``, the quickstart and the tests: a real
vLLM server and the Transformers fallback both load it, so the whole stack
runs on a laptop CPU without downloading anything.

What gets written (≈ 3 MB):

- a byte-level BPE tokenizer trained with ``tokenizers`` on the English text
  embedded below, saved as a ``PreTrainedTokenizerFast`` with a ChatML chat
  template (``<|im_start|>role\\ncontent<|im_end|>\\n``; eos = ``<|im_end|>``)
  that also renders tools and tool calls the Hermes way (``<tool_call>``);
- a 2-layer Llama (hidden 128, head_dim 64 — vLLM's CPU attention kernel
  needs head_dim ≥ 32) with random float32 weights in safetensors;
- ``generation_config.json`` whose eos is ``<|im_end|>``, so generation stops
  at the end of an assistant turn;
- a marker file naming the format version and seed.

The output is deterministic for a given seed, and the directory appears
atomically (built in a temporary sibling, then renamed), so concurrent
callers never see half a model.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "MARKER_FILE",
    "SPECIAL_TOKENS",
    "TINY_MODEL_VERSION",
    "is_tiny_model",
    "write_tiny_model",
]

log = logging.getLogger(__name__)

#: Bump when the output changes (tokenizer corpus, architecture, files):
#: caches key on it (e.g. ``~/.cache/brownout/tiny-model-v2``).
#: v2: the chat template renders tools, tool calls and tool results (Hermes style).
TINY_MODEL_VERSION = 2

MARKER_FILE = "brownout-tiny-model.json"

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")

VOCAB_SIZE = 1536

# The usual ChatML template with the Hermes/Qwen2.5 tools section. Every message
# ends with "<|im_end|>\n", which is what transformers' and vLLM's
# `continue_final_message` expect: they render the template, then cut the text
# right after the final message's content.
#
# With `tools`, the system turn lists them inside <tools></tools> (one JSON
# object per line) and tells the model to answer with
# <tool_call>{"name": ..., "arguments": ...}</tool_call>; an assistant turn's
# `tool_calls` are rendered the same way, and `tool` messages become
# <tool_response> blocks in a user turn.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\\n\\n' }}"
    "{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.'"
    " + '\\n\\nYou are provided with function signatures within <tools></tools> XML tags:'"
    " + '\\n<tools>' }}"
    "{%- for tool in tools %}"
    "{{- '\\n' + (tool | tojson) }}"
    "{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name'"
    " + ' and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    ' + \'{"name": <function-name>, "arguments": <args-json-object>}\''
    " + '\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}"
    "{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{%- if loop.first and message['content'] %}{{- '\\n' }}{%- endif %}"
    "{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set args = fn['arguments'] %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{{- (args if args is string else (args | tojson)) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Training text for the tokenizer: varied everyday and operations English so
# the merges cover common words; a model trained on nothing would still
# tokenize, but byte by byte, which makes token counts unrealistic.
_CORPUS = """\
The quick brown fox jumps over the lazy dog.
Hello! How can I help you today?
Thank you for your patience while we look into this.
Our service is currently under maintenance. Please try again in a few minutes.
The assistant answers questions about orders, billing, shipping and returns.
You can reset your password from the account settings page.
If you did not receive the email, check your spam folder first.
Refunds are usually processed within five to seven business days.
We ship to most countries in Europe, North America and Asia.
The package left our warehouse on Monday morning and should arrive on Thursday.
Please share your order number so that I can check the status.
I am sorry, but I could not find an order with that number.
Would you like me to connect you with a human agent?
The weather today is sunny with a light breeze from the west.
It rained all night, and the streets were still wet in the morning.
She opened the window and listened to the birds singing in the garden.
He walked to the station, bought a ticket and waited for the train.
The train was late because of a signal failure near the bridge.
They decided to have dinner at the small restaurant around the corner.
The soup was hot, the bread was fresh, and the coffee was strong.
A good answer is short, clear and correct.
Write a summary of the document in three sentences.
Translate the following sentence into French.
Explain the difference between a process and a thread.
A process has its own memory; threads inside a process share memory.
The server accepts requests over HTTP and returns JSON responses.
When the queue is full, new requests wait or receive an error.
The load balancer sends traffic to the healthy instances only.
A circuit breaker opens after several failures and closes again after a pause.
Latency is the time between a request and its response.
Throughput is the number of requests handled per second.
The first token arrived after two hundred milliseconds.
Memory usage grew slowly until the process was restarted.
The engine ran out of memory and had to be restarted.
We switched to the backup server while the main one recovered.
Monitoring shows the error rate, the latency and the queue length.
An alert fires when the latency stays above the threshold for five minutes.
The operator checked the dashboard and saw that everything was green again.
Configuration files are written in YAML and reloaded without a restart.
A bad configuration is rejected, and the previous one stays active.
The model generates text one token at a time.
Each token is a small piece of a word, a whole word or a punctuation mark.
The context window limits how much text the model can read at once.
Old messages are dropped when the conversation grows too long.
The system prompt tells the assistant how to behave.
The user asked a question, and the assistant answered politely.
Streaming responses let the user see the answer as it is written.
Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in many texts.
The meeting starts at 9:30 and ends at 11:00.
The price is 19.99 dollars, including taxes and shipping.
Call us at any time; our support team is available day and night.
Open the file, read each line, and count the words.
The function returns a list of numbers sorted from smallest to largest.
If the input is empty, the function returns an empty list.
Python, Rust, Go and JavaScript are popular programming languages.
A database stores data in tables made of rows and columns.
The cache keeps recent results in memory to answer faster.
Backups are taken every night and kept for thirty days.
The library is open from Monday to Saturday.
Children played football in the park until the sun went down.
The mountain was covered with snow, and the lake below was frozen.
We planted tomatoes, beans and potatoes in the spring.
The cat slept on the warm windowsill all afternoon.
My favourite books are about history, science and travel.
The museum has a large collection of paintings and old maps.
She studied medicine at the university and became a doctor.
He plays the piano every evening after work.
The city is famous for its bridges, markets and music.
The river flows through the valley towards the sea.
Winter is cold and dark, but summer days are long and bright.
Please keep your answer under one hundred words.
Can you give me an example?
Yes, of course. Here is a simple example.
No, that is not possible right now.
Let me think about that for a moment.
First, second, third, and finally, the last step.
This is important: always save your work before closing the program.
Good morning, good afternoon, good evening and good night.
What time is it? Where are you going? Why did it stop? Who called?
The answer depends on several factors, including cost and time.
In short, the new version is faster, smaller and easier to use.
The team fixed the bug, wrote a test and released a new version.
Users reported that the page loaded slowly during the evening peak.
The proxy limits the number of requests sent to the engine at the same time.
Requests that cannot be served quickly receive a polite message instead.
The frequently asked questions page explains how to change your plan.
You can cancel your subscription at any time without extra fees.
Your data is stored securely and never shared with third parties.
The weather forecast says there will be rain tomorrow afternoon.
The store closes early on public holidays.
We are happy to hear that the problem is solved.
Please describe the problem in as much detail as possible.
Restarting the application often fixes temporary errors.
The update will be installed automatically tonight.
Make sure that your device is connected to the internet.
The battery lasts about ten hours with normal use.
The screen is bright, the keyboard is quiet, and the laptop is light.
An apple, a banana, an orange and a handful of grapes.
Water boils at one hundred degrees Celsius at sea level.
The earth goes around the sun once a year.
Light travels faster than sound.
Cities grow when people move from the countryside to find work.
Music, art and stories help people share their feelings.
The old man told the children a story about a dragon and a brave girl.
Once upon a time, there was a small village at the edge of a forest.
Every morning the baker made bread, cakes and sweet rolls.
The teacher asked the students to write an essay about their summer.
A friendly dog followed us all the way home.
The hotel room was clean, quiet and comfortable.
We booked a table for four people at eight o'clock.
Could you please repeat the question?
I do not know the answer, but I can try to find out.
According to the report, sales increased by twelve percent last quarter.
The company hired new engineers to improve the product.
Safety comes first: wear a helmet when you ride a bicycle.
The doctor recommended rest, water and healthy food.
Exercise, sleep and good friends make people happier.
The road was closed, so we took a longer route through the hills.
Turn left at the traffic lights, then go straight for two hundred metres.
The airport is forty minutes from the city centre by bus.
Our flight was delayed because of strong winds.
The children built a sandcastle on the beach.
Stars filled the sky, and the moon rose above the trees.
He forgot his umbrella and got wet on the way to work.
She wrote a letter to her grandmother every week.
The garden looks beautiful when the roses are in bloom.
There are seven days in a week and twelve months in a year.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.
January, February, March, April, May, June, July, August, September, October, November, December.
Spring, summer, autumn and winter each have their own colours.
The kitchen smelled of fresh coffee, warm bread and cinnamon.
He looked at the clock and realised that he was already late.
The bus was crowded, so she decided to walk instead.
The students listened carefully while the professor explained the theory.
The experiment failed twice before it finally worked.
Scientists measure temperature, pressure and speed with great care.
The history of the city goes back more than two thousand years.
The king and the queen lived in a castle on a hill above the town.
A small boat sailed slowly across the calm blue water.
The farmer feeds the animals early every morning.
Horses, cows, sheep and chickens live on the farm.
The forest is home to deer, foxes, owls and many kinds of insects.
We heard thunder in the distance and saw lightning over the hills.
The shop sells fruit, vegetables, cheese, milk and eggs.
Do you prefer tea or coffee in the morning?
I usually drink a glass of water before breakfast.
The recipe needs two eggs, a cup of flour and a little sugar.
Mix the ingredients, pour them into a pan and bake for thirty minutes.
The film was long, but the ending was surprising and moving.
The audience clapped loudly when the concert ended.
The newspaper published an article about the new hospital.
The government announced a plan to build more schools and roads.
Prices went up last year, and many families had to save money.
The bank opens at nine and closes at five on weekdays.
Please sign the form and return it before the end of the month.
Your account has been updated successfully.
Something went wrong. Please try again later.
The request timed out because the server did not respond in time.
The connection was refused, so the client tried another address.
Too many requests were sent in a short time; please slow down.
The service is temporarily unavailable due to high demand.
We are working on a fix and will update this page soon.
All systems are operating normally.
The status page shows the current state of every component.
Engineers deploy new versions gradually to a small share of users first.
If errors increase, the deployment is rolled back automatically.
The health check returns success when the service is ready.
Logs, metrics and traces help engineers understand what happened.
The graph shows that the response time doubled during the incident.
After the incident, the team wrote a report and listed the lessons learned.
A good design keeps each part small, simple and easy to test.
Tests check that the code behaves as expected.
The documentation explains how to install, configure and run the program.
Run the command in a terminal and wait until it finishes.
The download finished, and the installation took about two minutes.
Open the settings menu, choose a language and press save.
The password must contain at least eight characters.
Your session expired; please sign in again.
The message was delivered, read and answered within an hour.
She smiled, waved goodbye and closed the door behind her.
The children laughed at the funny clown at the birthday party.
We watched the sunset from the top of the old tower.
The painter used bright colours to show the joy of the festival.
Reading every day improves vocabulary and concentration.
Learning a new language takes time, practice and patience.
He answered the phone and spoke quietly so as not to wake the baby.
The nurse checked the patient's temperature every four hours.
The machine makes a strange noise when it starts.
The engine of the car would not start on that cold morning.
A mechanic repaired the brakes and changed the oil.
The bridge was built in the last century and is still in use.
Trains, buses and trams connect the suburbs with the city centre.
Many people work from home on Fridays.
The office is on the third floor, next to the lift.
Lunch is served between twelve and two in the cafeteria.
The report is due next week, so we should start writing it now.
Could you send me the file by email, please?
Thanks for your message; I will reply as soon as possible.
Best regards, and have a nice weekend.
"""

# Short template sentences multiply the corpus into a few hundred lines of
# plausible text with numbers and names, cheaply and deterministically.
_SUBJECTS = (
    "The user",
    "The assistant",
    "The operator",
    "The server",
    "My friend",
    "The engineer",
    "Our team",
    "The customer",
    "The teacher",
    "The driver",
)
_PREDICATES = (
    "waited for {n} seconds before trying again.",
    "sent {n} messages this morning.",
    "asked about order number {n}.",
    "restarted the service at {n} o'clock.",
    "read {n} pages of the manual.",
    "counted {n} requests in the queue.",
    "answered {n} questions without a single error.",
    "walked {n} kilometres along the river.",
)


def _training_lines() -> list[str]:
    lines = [line for line in _CORPUS.splitlines() if line]
    for i, subject in enumerate(_SUBJECTS):
        for j, predicate in enumerate(_PREDICATES):
            lines.append(f"{subject} {predicate.format(n=(i * 37 + j * 11) % 120 + 1)}")
    # Chat-formatted samples so role names and the newline after the role
    # header become single tokens, as in real ChatML tokenizers.
    for role, text in (("system", "You are a helpful assistant."), ("user", "Hello!")):
        lines.append(f"<|im_start|>{role}\n{text}<|im_end|>\n<|im_start|>assistant\n")
    # Tool calls too, so their tags and JSON punctuation are a few tokens each.
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    lines.extend([call] * 4)
    lines.append('{"answer": "yes"} {"answer": "no"} <tool_response>\nsunny\n</tool_response>')
    return lines


def _build_tokenizer(work: Path) -> Any:
    """Train the byte-level BPE and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # The full byte alphabet so any input (emoji, U+FFFD, …) is encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_lines(), trainer=trainer)

    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="</s>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(work))
    # transformers 5 records its internal class name ("TokenizersBackend");
    # the public name loads in every transformers version, including vLLM's.
    config_path = work / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text(encoding="utf-8"))
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    return fast


def _build_model(work: Path, tokenizer: Any, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    bos_id = tokenizer.convert_tokens_to_ids("<s>")
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("</s>")
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        # head_dim = 128 / 2 = 64; vLLM's CPU attention refuses head_dim < 32.
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
    )
    config.dtype = torch.float32
    # fork_rng: seed locally without disturbing the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.save_pretrained(str(work), safe_serialization=True)


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_tiny_model(path: str | Path, seed: int | None = None) -> bool:
    """True if ``path`` holds a complete tiny model of the current version.

    The marker is written last, before the atomic rename, so its presence
    means the directory is complete.
    """
    marker = _read_marker(Path(path))
    if marker is None or marker.get("version") != TINY_MODEL_VERSION:
        return False
    return seed is None or marker.get("seed") == seed


def _install(tmp: Path, dest: Path, seed: int) -> None:
    """Move the finished ``tmp`` to ``dest`` without exposing a partial model."""
    try:
        # rename(2) also atomically replaces an *empty* directory.
        tmp.rename(dest)
        return
    except OSError:
        if not dest.exists():
            raise
    if is_tiny_model(dest, seed):
        # Same version and seed means identical content: a concurrent caller
        # won the race (or it was already there). Keep theirs.
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if _read_marker(dest) is None:
        # Never delete a directory we did not write.
        shutil.rmtree(tmp, ignore_errors=True)
        raise FileExistsError(
            f"{dest} exists and is not a brownout tiny model; refusing to replace it"
        )
    # An older tiny model (other seed or version): swap it out, then delete it.
    trash = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
    dest.rename(trash / "model")
    tmp.rename(dest)
    shutil.rmtree(trash, ignore_errors=True)


def write_tiny_model(dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny model to ``dir`` and return its absolute path.

    Never touches the network. Deterministic for a given ``seed``. If ``dir``
    already holds a tiny model of this version and seed it is kept as is; an
    older tiny model is replaced; any other non-empty directory is an error.
    """
    dest = Path(dir).expanduser().resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        tokenizer = _build_tokenizer(tmp)
        log.info("tiny model: tokenizer trained, vocab %d", len(tokenizer))
        _build_model(tmp, tokenizer, seed)
        log.info("tiny model: weights written (seed %d)", seed)
        marker = {"version": TINY_MODEL_VERSION, "seed": seed, "vocab_size": len(tokenizer)}
        (tmp / MARKER_FILE).write_text(json.dumps(marker) + "\n", encoding="utf-8")
        # mkdtemp (and safetensors' own temp file) create owner-only modes;
        # make the model readable like any other directory.
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        _install(tmp, dest, seed)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("tiny model: %s ready in %.1f s", dest, time.monotonic() - started)
    return dest
