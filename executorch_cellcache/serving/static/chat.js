// The chat page of `cellcache serve`: one conversation against this server's
// POST v1/chat/completions, streamed (server-sent events).
//
// - Each turn resends the whole conversation (system prompt, every earlier
//   turn, the new message); the server's prefix cache serves the part it has
//   seen, and the reply's line says how many prompt tokens came from it
//   (usage.prompt_tokens_details.cached_tokens, from the stream's usage chunk).
// - Stop aborts the request; the server cancels it when the connection closes.
//   A stopped or cut reply stays in the conversation as far as it got.
// - Every error is shown: the server's own message (OpenAI's error body
//   {"error": {"message"}}), an error chunk inside a stream, a stream that ends
//   before "data: [DONE]", a connection that fails.
// - With an API key, every v1 call sends "Authorization: Bearer KEY".
"use strict";

const $ = (id) => document.getElementById(id);

const chat = {
  history: [],        // [{role, content}] of finished turns, without the system prompt
  controller: null,   // the AbortController of the request in flight, or null
};

// ------------------------------------------------------------------ the server

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// The message of a non-2xx answer: OpenAI's error body, else the HTTP status.
async function errorMessage(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) {
      message = `${response.status}: ${body.error.message}`;
    }
  } catch (e) {
    // not JSON: the status line is all there is
  }
  if (response.status === 401) message += " (enter the server's API key on the left)";
  return message;
}

async function loadModels() {
  let response;
  try {
    response = await fetch("v1/models", { headers: headers() });
  } catch (e) {
    return showStatus(`cannot reach the server: ${e.message}`, "error");
  }
  if (!response.ok) {
    if (response.status === 503) setTimeout(loadModels, 2000);   // loading: ask again
    return showStatus(await errorMessage(response), "error");
  }
  const select = $("model");
  const chosen = select.value;
  select.replaceChildren(...(await response.json()).data.map((m) => new Option(m.id, m.id)));
  if (chosen) select.value = chosen;
  if (!select.value && select.options.length) select.selectedIndex = 0;
  showStatus("");
}

// The data of each server-sent event of a response body, as it arrives.
async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (data) yield data;
    }
  }
}

// ------------------------------------------------------------------ the page

function showStatus(text, kind = "") {
  const status = $("status");
  status.textContent = text;
  status.className = kind;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  div.append(body);
  $("messages").append(div);
  scrollDown();
  return div;
}

function addLine(message, className, text) {
  const line = document.createElement("div");
  line.className = className;
  line.textContent = text;
  message.append(line);
  scrollDown();
  return line;
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// A number field's value; undefined when empty (the server's default), Error when not a number.
function numberField(id, parse) {
  const field = $(id);
  if (!field.value.trim()) return undefined;
  const value = parse(field.value);
  if (Number.isNaN(value)) {
    const name = field.closest("label").firstChild.textContent.trim();
    throw new Error(`${name} must be a number`);
  }
  return value;
}

// response_format for the JSON-schema mode, or undefined; Error for a schema that is not JSON.
function responseFormat() {
  if (!$("json-mode").checked) return undefined;
  let schema;
  try {
    schema = JSON.parse($("schema").value);
  } catch (e) {
    throw new Error(`the JSON schema is not JSON: ${e.message}`);
  }
  const strict = $("strict").checked;
  return { type: "json_schema", json_schema: { name: "page_schema", schema, strict } };
}

function requestBody(messages) {
  const body = {
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField("temperature", parseFloat),
    max_tokens: numberField("max-tokens", (v) => parseInt(v, 10)),
  };
  if ($("model").value) body.model = $("model").value;
  const format = responseFormat();
  if (format) body.response_format = format;
  return body;
}

// "12 tokens · 85.2 tokens/s · first token 40 ms · 30 of 41 prompt tokens cached · stop"
function statsText(usage, times, finish) {
  const n = usage.completion_tokens;
  const decode = (times.last - times.first) / 1000;
  const rate = n > 1 && decode > 0 ? (n - 1) / decode : n / ((times.last - times.sent) / 1000);
  const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
  const parts = [`${n} tokens`, `${rate.toFixed(1)} tokens/s`,
    `first token ${Math.round(times.first - times.sent)} ms`,
    `${cached} of ${usage.prompt_tokens} prompt tokens cached`, finish];
  return parts.filter(Boolean).join(" · ");
}

// Streams one reply into `message`; returns {text, usage, finish, done}.
async function streamReply(response, message, times) {
  const text = message.querySelector(".text");
  const reply = { text: "", usage: null, finish: "", done: false };
  for await (const data of sseData(response.body)) {
    if (data === "[DONE]") {
      reply.done = true;
      break;
    }
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(`the server failed mid-reply: ${chunk.error.message}`);
    for (const choice of chunk.choices) {
      const piece = choice.delta && choice.delta.content;
      if (piece) {
        if (times.first === null) times.first = performance.now();
        reply.text += piece;
        text.textContent = reply.text;
        scrollDown();
      }
      if (choice.finish_reason) reply.finish = choice.finish_reason;
    }
    if (chunk.usage) reply.usage = chunk.usage;
  }
  times.last = performance.now();
  if (times.first === null) times.first = times.last;
  return reply;
}

async function send(event) {
  event.preventDefault();
  if (chat.controller) return;
  const input = $("input");
  const content = input.value;
  if (!content.trim()) return showStatus("Type a message first.", "error");
  const user = { role: "user", content };
  const system = $("system").value.trim();
  const head = system ? [{ role: "system", content: system }] : [];
  const conversation = chat.history;   // "New chat" replaces it: a late reply stays out
  const messages = [...head, ...conversation, user];
  let body;
  try {
    body = requestBody(messages);
  } catch (e) {
    return showStatus(e.message, "error");
  }
  showStatus("");
  input.value = "";
  addMessage("user", content);
  const message = addMessage("assistant", "");
  message.classList.add("streaming");
  chat.controller = new AbortController();
  setBusy(true);
  const times = { sent: performance.now(), first: null, last: null };
  let reply = { text: "", usage: null, finish: "", done: false };
  let error = null;
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(body),
      signal: chat.controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    reply = await streamReply(response, message, times);
    if (!reply.done) error = "the server closed the connection before the reply finished";
  } catch (e) {
    if (e.name === "AbortError") reply.finish = "stopped";
    else if (e.name === "TypeError") error = `the connection to the server failed: ${e.message}`;
    else error = e.message;
  } finally {
    chat.controller = null;
    setBusy(false);
    message.classList.remove("streaming");
  }
  const partial = message.querySelector(".text").textContent;
  if (partial) {
    conversation.push(user, { role: "assistant", content: partial });
  } else {
    message.classList.add("empty");
    if (!input.value) input.value = content;   // nothing came back: the message can be sent again
  }
  if (error) addLine(message, "error", error);
  if (reply.finish === "stopped") addLine(message, "stats stopped", "stopped");
  else if (reply.usage) addLine(message, "stats", statsText(reply.usage, times, reply.finish));
  input.focus();
}

function stop() {
  if (chat.controller) chat.controller.abort();
}

function newChat() {
  stop();
  chat.history = [];
  $("messages").replaceChildren();
  showStatus("");
  $("input").focus();
}

function toggleJsonMode() {
  const on = $("json-mode").checked;
  $("schema").disabled = !on;
  $("strict").disabled = !on;
}

document.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", send);
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("json-mode").addEventListener("change", toggleJsonMode);
  $("api-key").addEventListener("change", loadModels);
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  toggleJsonMode();
  loadModels();
  $("input").focus();
});
