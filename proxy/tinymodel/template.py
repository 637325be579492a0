"""The tiny model's chat template: ChatML with the Hermes/Qwen2.5 tools section."""

from __future__ import annotations

__all__ = ["CHAT_TEMPLATE"]

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
